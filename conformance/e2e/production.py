"""What a target's process hands the referee for one end-to-end case: plain data, nothing more.

The target's side (:mod:`conformance.e2e.target_runner`) runs the batches a case needs on the target's
engine and returns an :class:`E2EProduction`; the referee (:mod:`conformance.e2e.referee`) judges it against
the float64 reference. Neither side hands the other an object the other's code made: the production holds
:class:`~conformance.e2e.generation.Generation` values rebuilt from ``int``, ``float`` and ``str`` only
(:func:`plain_generations`), crosses the pipe as JSON (``conformance.wire``) and is read back by
:func:`read_production`, which builds it from the declared types alone and refuses a production of another
case or with more repetitions than were asked for.

Which batches a case runs (:func:`batch_plan`) is data both sides read: the target's side to run them, the
referee to check the production has exactly them before it judges a single number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from conformance.wire import WireError, from_data

from .cases import E2ECase
from .generation import Generation, Request, Step

RAN, NOT_SUPPORTED, RAISED = "ran", "not_supported", "raised"
STATUSES = (RAN, NOT_SUPPORTED, RAISED)
WHOLE_BATCH = "batch"
# How a planned batch runs on the target's engine: as served with LoRA (every check's batches), with LoRA
# disabled (base-request invariance: the same engine built without LoRA), or with its decode steps replayed
# from captured graphs (graphs vs eager).
LORA, LORA_DISABLED, GRAPHS = "lora", "lora disabled", "graphs"
ENGINES = (LORA, LORA_DISABLED, GRAPHS)
BASE_CHECK, GRAPHS_CHECK = "LoRA disabled", "graphs"  # the names of those two batches in a case's plan


class PlannedRun(NamedTuple):
    """One batch a case runs: a name, the request indices in batch order, and what is asked of it."""

    name: str  # unique within the case: "batch", "alone 3", "reversed", "rotated"
    order: tuple[int, ...]  # indices into the case's requests, in the order the batch holds them
    score: bool  # teacher-forced on the reference's continuations
    generate: bool  # free-running greedy
    against: str | None  # for an invariance check, how its messages name this batch (compare.Comparison)
    engine: str = LORA  # LORA, LORA_DISABLED or GRAPHS


def batch_plan(case: E2ECase) -> tuple[PlannedRun, ...]:
    """The batches the case's check runs, the whole batch first (``ValueError`` for an unknown check).

    teacher_forced_logits and token_classification score the whole batch, greedy_generation generates it; the invariance checks
    score and generate the whole batch and then each other batch: every request alone (batch_invariance),
    or the batch reversed and rotated by one (order_invariance).
    """
    return (*check_plan(case), *engine_checks(case))


def engine_checks(case: E2ECase) -> tuple[PlannedRun, ...]:
    """The batches every case adds to its check's: the whole batch with LoRA disabled, scored and generated as
    the whole batch is (base-request invariance; none for a batch without base requests), and the whole batch
    generated with captured graphs (graphs vs eager; none for a token classifier, which runs one prefill and no
    decode step)."""
    whole = check_plan(case)[0]
    everyone = whole.order
    runs = []
    if any(request.adapter is None for request in case.requests):
        runs.append(PlannedRun(BASE_CHECK, everyone, whole.score, whole.generate, "the same engine with LoRA disabled",
                               LORA_DISABLED))
    if not case.is_token_classifier:
        runs.append(PlannedRun(GRAPHS_CHECK, everyone, False, True, "the same engine run eagerly", GRAPHS))
    return tuple(runs)


def check_plan(case: E2ECase) -> tuple[PlannedRun, ...]:
    """The batches of the case's own check (``batch_plan`` without the engine checks)."""
    everyone = tuple(range(len(case.requests)))
    if case.kind in ("teacher_forced_logits", "token_classification"):
        return (PlannedRun(WHOLE_BATCH, everyone, True, False, None),)
    if case.kind == "greedy_generation":
        return (PlannedRun(WHOLE_BATCH, everyone, False, True, None),)
    if case.kind == "batch_invariance":
        others = [PlannedRun(f"alone {i}", (i,), True, True, "the same request alone") for i in everyone]
    elif case.kind == "order_invariance":
        others = [PlannedRun("reversed", everyone[::-1], True, True, "the batch reversed"),
                  PlannedRun("rotated", everyone[1:] + everyone[:1], True, True, "the batch rotated by one")]
    else:
        raise ValueError(f"unknown end-to-end check {case.kind!r}")
    return (PlannedRun(WHOLE_BATCH, everyone, True, True, None), *others)


@dataclass(frozen=True)
class BatchRun:
    """What the target's engine returned for one planned batch (``None``: not asked of this batch, or, with a
    ``note``, not run: the graphs batch of a target that captures no graphs says why in its note)."""

    name: str
    order: tuple[int, ...]
    scored: tuple[Generation, ...] | None = None  # teacher-forced, one per request in ``order``
    generated: tuple[Generation, ...] | None = None  # greedy, one per request in ``order``
    note: str | None = None  # why the batch did not run ("eager only: …", "not supported here: …")


Repetition = tuple[BatchRun, ...]  # every planned batch, in plan order, once


@dataclass
class E2EProduction:
    """One case's production by the target: ``status`` ``"ran"``, ``"not_supported"`` or ``"raised"``.

    ``message``: why not supported, or what the target raised (``"TypeName: message (at file:line)"``),
    and ``traceback`` its whole traceback, formatted in the target's process
    (``conformance.text.format_traceback``), ``raised`` its type and the innermost frame of the target's code
    (``conformance.text.raised_at``). ``seconds``: the time the target's side spent on the case.
    ``repetitions``: for ``"ran"``, every repetition of the whole production (``runs`` of them, on one
    engine); the referee judges the first and compares the others with it bit for bit (a determinism
    measure).
    """

    case_id: str
    status: Literal["ran", "not_supported", "raised"]
    message: str = ""
    seconds: float = 0.0
    repetitions: list[Repetition] = field(default_factory=list)
    traceback: str | None = None
    raised: dict[str, str] | None = None

    @property
    def runs(self) -> int:
        return len(self.repetitions)

    def batch_runs(self) -> dict[str, BatchRun]:
        """The first repetition's batches by name (what is judged)."""
        return {run.name: run for run in self.repetitions[0]} if self.repetitions else {}


def plain_generation(generation) -> Generation:
    """A copy made of ``str``, ``int`` and ``float`` only, whatever an engine returned (0-d tensors, numpy
    scalars, subclasses): a production unpickles without the target's classes, on any device."""
    request = generation.request
    return Generation(
        Request(str(request.prompt), None if request.adapter is None else str(request.adapter)),
        tuple(int(token) for token in generation.prompt_ids),
        tuple(
            Step(int(step.token), float(step.logprob), tuple((int(t), float(lp)) for t, lp in step.top), float(step.routing_margin))
            for step in generation.steps
        ),
    )


def plain_generations(generations) -> tuple[Generation, ...]:
    return tuple(plain_generation(g) for g in generations)


def read_production(data, case: E2ECase, runs: int) -> E2EProduction:
    """The referee's reading of a production sent as data: ``WireError`` naming what is wrong (the case is then
    broken, ``malformed reply``); the referee's judge checks its batches against the plan."""
    production = from_data(E2EProduction, data, "the production")
    if production.case_id != case.case_id:
        raise WireError(f"the production is of case {production.case_id[:200]!r}, not {case.case_id!r}")
    if production.status == RAN and not 1 <= production.runs <= runs:
        raise WireError(f"the production holds {production.runs} repetition(s); {runs} were asked for")
    if production.status != RAN and production.repetitions:
        raise WireError(f"a production that {production.status} holds repetitions")
    return production
