"""The referee of an end-to-end case: the float64 reference and the judgement, never the target's code.

The reference is the suite's decoder on the golden reference target in float64 (itself checked against
transformers + PEFT in tests/e2e/test_e2e_oracle.py, on every fixture model). :class:`E2EReferee` draws the
reference's greedy continuations (:meth:`E2EReferee.continuations`, the input of the target's teacher-forced
scoring) and judges what the target's side produced (:meth:`E2EReferee.judge`, an
:class:`~conformance.e2e.production.E2EProduction` of plain data) by the rules of :mod:`conformance.e2e.compare`.

This module imports no target and none of the code that runs one (conformance.e2e.target_runner, the vLLM
engine): only ``conformance.targets.reference``, the referee's own code. So the referee can run in a
process where no target's code ever ran, and a target that patches torch cannot move the reference.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.ops import Level
from conformance.record import CaseResult
from conformance.verdict import FailureKind, Outcome
from conformance.verdict.failure_kind import ordered
from conformance.verdict.judge import json_number

from .adapters import Adapter
from .cases import DENSE_MODEL, MAX_NEW_TOKENS, TOP_K, E2ECase
from .checkpoint import Checkpoint
from .compare import GENERATION_TOLERANCES, Comparison, Problem
from .decoder_engine import DecoderEngine
from .fixture_files import FixtureFiles, fixtures_dir
from .generation import Generation, slot_assignment
from .production import (
    BASE_CHECK,
    GRAPHS,
    GRAPHS_CHECK,
    NOT_SUPPORTED,
    RAISED,
    RAN,
    WHOLE_BATCH,
    BatchRun,
    E2EProduction,
    Repetition,
    batch_plan,
    check_plan,
)

CHECKED = "checked"
NO_BASE_REQUEST = "not applicable: the batch has no request without an adapter"
ONE_PREFILL = "not applicable: a token classifier runs one prefill and no decode step"


@dataclass(frozen=True)
class FixtureModel:
    """One fixture model, its PEFT adapters, and the float64 reference decoder running them."""

    checkpoint: Checkpoint
    adapter_dirs: dict[str, Path]
    adapters: dict[str, Adapter]
    reference: DecoderEngine

    @classmethod
    def load(cls, fixtures: Path, model: str) -> FixtureModel:
        """``FileNotFoundError`` when the model is missing, ``ValueError`` for a malformed file."""
        files = FixtureFiles.load(fixtures, model)
        from conformance.targets.reference import ReferenceTarget

        reference = DecoderEngine(ReferenceTarget(), files.checkpoint, files.adapters, torch.float64)
        return cls(files.checkpoint, files.adapter_dirs, files.adapters, reference)


@dataclass(frozen=True)
class GeneratedTokens:
    """The token ids a case's target produced per request (batch order), beside the reference's.

    ``source`` says which: ``greedy`` (free-running greedy; for the invariance checks, the run of the
    whole batch in its own order) or ``top-1`` (teacher-forced: the target's top-1 at every position
    of the reference's continuation). Kept small (a few requests × ``MAX_NEW_TOKENS`` ids), so that
    runs of two targets can be told apart token by token without the logits.
    """

    source: str
    target: tuple[tuple[int, ...], ...]
    reference: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, source: str, got: list[Generation], reference: list[Generation]) -> GeneratedTokens:
        if source == "top-1":
            target = tuple(tuple(step.top[0][0] for step in g.steps) for g in got)
        else:
            target = tuple(g.tokens for g in got)
        return cls(source, target, tuple(g.tokens for g in reference))

    def to_json(self) -> dict:
        return {"source": self.source, "target": [list(t) for t in self.target], "reference": [list(t) for t in self.reference]}


@dataclass
class E2EResult(CaseResult):
    """One end-to-end case's result: an op case's record, at level "model", measured in log-probs.

    ``failing_slots`` are the slots of the failing requests (−1 = a base request), so expectations'
    ``failing_rows = "no-adapter"`` reads them as it reads an op case's rows. ``determinism`` (a production
    of several runs): ``{"runs": n, "identical": bool, "max_logprob_difference": float}``, the later runs
    against the first, which alone is judged, and ``stability`` ``deterministic`` or ``nondeterministic``
    accordingly; both ``None`` for one run.
    """

    case: E2ECase
    max_logprob_error: float | None = None  # against the reference (invariance: between the two runs)
    tokens: GeneratedTokens | None = None  # what the target generated (None: it generated nothing)
    # the checks every case adds, by name ("base_request_invariance", "graphs_vs_eager"): "checked", or why not
    engine_checks: dict[str, str] | None = None

    @property
    def level(self) -> Level:
        return Level.MODEL

    def to_json(self) -> dict:
        """The op record (its ``determinism`` is this case's, above), and the generated tokens (``python -m
        conformance.report compare`` compares them)."""
        return {**super().to_json(), "tokens": self.tokens.to_json() if self.tokens else None,
                "engine_checks": self.engine_checks}

    def measurement_json(self) -> dict | None:
        """The largest log-prob error and its ratio to the dtype's bound (the report's budget ratio)."""
        if self.max_logprob_error is None:
            return None
        bound = GENERATION_TOLERANCES[self.case.dtype].logprob_error
        # an infinite error (a token the target gave no probability) as the text "inf": results.json is JSON
        return {"max_logprob_error": json_number(self.max_logprob_error), "budget_ratio": json_number(self.max_logprob_error / bound)}


class E2EReferee:
    """Per process: the fixtures and the float64 reference engines; the reference's generations per batch.

    The dense model is loaded up front (so missing fixtures show at once), the others by their first case.
    """

    def __init__(self, fixtures: Path | None = None) -> None:
        self.fixtures = fixtures or fixtures_dir()
        self._models: dict[str, FixtureModel] = {}
        self.tokenizer = self.model(DENSE_MODEL).checkpoint.tokenizer()  # every fixture model has this tokenizer
        self._references: dict[str, list[Generation]] = {}

    def model(self, name: str) -> FixtureModel:
        """A fixture model with its adapters and reference (loaded once)."""
        if name not in self._models:
            self._models[name] = FixtureModel.load(self.fixtures, name)
        return self._models[name]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def reference_generations(self, case: E2ECase) -> list[Generation]:
        """The float64 reference's greedy generations of the case's batch (computed once per batch)."""
        if case.batch not in self._references:
            reference = self.model(case.model).reference
            self._references[case.batch] = reference.generate(case.requests, MAX_NEW_TOKENS, TOP_K, case.max_loras)
        return self._references[case.batch]

    def continuations(self, case: E2ECase) -> list[list[int]]:
        """The reference's greedy tokens per request: what the target's teacher-forced scoring is fed."""
        return [list(g.tokens) for g in self.reference_generations(case)]

    def judge(self, case: E2ECase, production: E2EProduction) -> E2EResult:
        """The case's result from the target's production, by the rules of :mod:`conformance.e2e.compare`."""
        if production.case_id != case.case_id:
            raise ValueError(f"a production of {production.case_id} cannot be judged as {case.case_id}")
        features = case.features()
        if production.status == NOT_SUPPORTED:
            return E2EResult(case.case_id, case, Outcome.NOT_SUPPORTED, production.message, features=features)
        if production.status == RAISED:
            return E2EResult(case.case_id, case, Outcome.BROKEN, production.message, features=features,
                             seconds=production.seconds, kinds=(FailureKind.RAISED,), traceback=production.traceback,
                             raised=production.raised)
        if production.status != RAN:
            raise ValueError(f"{case.case_id}: unknown production status {production.status!r}")
        determinism = measure_determinism(production.repetitions)
        stability = None if determinism is None else "deterministic" if determinism["identical"] else "nondeterministic"
        measured = {"seconds": production.seconds, "determinism": determinism, "stability": stability}
        reference = self.reference_generations(case)
        malformed = self._malformed(case, production.repetitions[0] if production.repetitions else None)
        if malformed:
            _, slots = slot_assignment(case.requests, case.max_loras)
            return E2EResult(case.case_id, case, Outcome.FAIL, f"the target's engine returned malformed output: {malformed}",
                             features=features, failing_slots=tuple(sorted(set(slots))),
                             kinds=(FailureKind.WRONG_OUTPUT_TYPE,), **measured)
        runs = production.batch_runs()
        measured["engine_checks"] = engine_checks(case, runs)
        problems, max_error, tokens = self._check(case, runs, reference)
        problems = self._engine_problems(case, runs, reference, problems)
        if not problems:
            return E2EResult(case.case_id, case, Outcome.PASS, features=features, max_logprob_error=max_error, tokens=tokens,
                             **measured)
        _, slots = slot_assignment(case.requests, case.max_loras)
        failing = sorted({p.request_index for p in problems})
        problems = sorted(problems, key=lambda p: p.request_index)
        message = f"{len(failing)} of {len(case.requests)} requests fail\n" + "\n".join(p.message for p in problems)
        return E2EResult(
            case.case_id, case, Outcome.FAIL, message, features=features, failing_slots=tuple(slots[i] for i in failing),
            max_logprob_error=max_error, kinds=ordered(kind for p in problems for kind in p.kinds), tokens=tokens, **measured,
        )

    def _malformed(self, case: E2ECase, repetition: Repetition | None) -> str | None:
        """What keeps the first repetition from being judged: not the case's planned batches, or a batch
        whose generations are not one per request, for those requests; ``None`` when it can be judged."""
        plan = batch_plan(case)
        if repetition is None or [(r.name, tuple(r.order)) for r in repetition] != [(p.name, p.order) for p in plan]:
            got = None if repetition is None else [r.name for r in repetition]
            raise ValueError(f"{case.case_id}: the production's batches {got} are not the case's plan {[p.name for p in plan]}")
        requests = case.requests
        for planned, run in zip(plan, repetition):
            for what, asked, generations in (("scored", planned.score, run.scored), ("generated", planned.generate, run.generated)):
                if not asked:
                    continue
                if generations is None and run.note and planned.engine == GRAPHS:
                    continue  # the engine captures no graphs: the note says why (the result's engine_checks)
                if generations is None or len(generations) != len(planned.order):
                    count = "nothing" if generations is None else f"{len(generations)} generations"
                    return f"batch {run.name!r}: {what} {count} for its {len(planned.order)} requests"
                for position, (i, generation) in enumerate(zip(planned.order, generations)):
                    if not isinstance(generation, Generation) or generation.request != requests[i]:
                        return f"batch {run.name!r}: {what} generation {position} is not request {requests[i].describe()}"
        return None

    def _check(self, case: E2ECase, runs: dict[str, BatchRun], reference: list[Generation]
               ) -> tuple[list[Problem], float | None, GeneratedTokens]:
        compare = Comparison(case.dtype, show_labels if case.is_token_classifier else self.decode)
        continuations = [g.tokens for g in reference]
        whole = runs[WHOLE_BATCH]
        problems: list[Problem] = []
        for run in runs.values():  # teacher forcing scores the continuation it was fed, no other
            for i, got in zip(run.order, run.scored or ()):
                problems += _fed_other_tokens(compare, i, got, continuations[i])
        if case.kind in ("teacher_forced_logits", "token_classification"):  # a token's labels are scored like tokens
            got = list(whole.scored)
            for i, (mine, ref) in enumerate(zip(got, reference)):
                problems += compare.scores(i, mine, ref)
            return problems, compare.max_logprob_error(got, reference), GeneratedTokens.of("top-1", got, reference)
        if case.kind == "greedy_generation":
            got = list(whole.generated)
            for i, (mine, ref) in enumerate(zip(got, reference)):
                problems += compare.greedy(i, mine, ref)
            return problems, compare.max_logprob_error(got, reference, common_prefix=True), GeneratedTokens.of("greedy", got, reference)
        scored, generated = list(whole.scored), list(whole.generated)
        worst = 0.0
        for planned in check_plan(case)[1:]:
            other = runs[planned.name]
            for position, i in enumerate(planned.order):
                problems += compare.scores(i, scored[i], other.scored[position], planned.against)
                problems += compare.greedy(i, generated[i], other.generated[position], planned.against)
            worst = max(worst, compare.max_logprob_error(list(other.scored), [scored[i] for i in planned.order]))
        return problems, worst, GeneratedTokens.of("greedy", generated, reference)


    def _engine_problems(self, case: E2ECase, runs: dict[str, BatchRun], reference: list[Generation],
                         problems: list[Problem]) -> list[Problem]:
        """``problems`` and those of the checks every case adds.

        Base-request invariance: each request without an adapter against the same request in the batch run with
        LoRA disabled, by the invariance rules (what the whole batch scored and generated); a difference is
        ``BASE_CHANGED``, and it is the cause of whatever else that request shows, so all of that request's
        problems take that kind alone. Graphs vs eager: the batch generated from captured graphs against the
        reference and against the eager run (where the case's check generated the whole batch): ``TOKENS``.
        """
        compare = Comparison(case.dtype, show_labels if case.is_token_classifier else self.decode)
        whole, found = runs[WHOLE_BATCH], []
        if (base := runs.get(BASE_CHECK)) is not None:
            against = "the same engine with LoRA disabled"
            for position, i in enumerate(base.order):
                if case.requests[i].adapter is not None:
                    continue
                if base.scored is not None:
                    found += compare.scores(i, whole.scored[i], base.scored[position], against)
                if base.generated is not None:
                    found += compare.greedy(i, whole.generated[i], base.generated[position], against)
            found = [Problem(p.request_index, p.generation, f"base-request invariance: {p.message}",
                             frozenset({FailureKind.BASE_CHANGED})) for p in found]
        graphs = runs.get(GRAPHS_CHECK)
        if graphs is not None and graphs.generated is not None:
            eager = "the same engine run eagerly"
            for position, i in enumerate(graphs.order):
                mine = graphs.generated[position]
                found += [Problem(p.request_index, p.generation, f"with captured graphs: {p.message}", p.kinds)
                          for p in compare.greedy(i, mine, reference[i])
                          + (compare.greedy(i, mine, whole.generated[i], eager) if whole.generated is not None else [])]
        changed = {p.request_index for p in found if FailureKind.BASE_CHANGED in p.kinds}
        return [p if p.request_index not in changed else Problem(p.request_index, p.generation, p.message,
                                                                  frozenset({FailureKind.BASE_CHANGED}))
                for p in problems + found]


def engine_checks(case: E2ECase, runs: dict[str, BatchRun]) -> dict[str, str]:
    """What the result says of the checks every case adds: ``"checked"``, or why not."""
    graphs = runs.get(GRAPHS_CHECK)
    return {
        "base_request_invariance": CHECKED if BASE_CHECK in runs else NO_BASE_REQUEST,
        "graphs_vs_eager": ONE_PREFILL if graphs is None else graphs.note or CHECKED,
    }


def show_labels(ids: list[int]) -> str:
    """A token classifier's labels as its config names them (``LABEL_<i>``), for messages."""
    return " ".join(f"LABEL_{i}" for i in ids)


def _fed_other_tokens(compare: Comparison, index: int, got: Generation, fed: tuple[int, ...]) -> list[Problem]:
    """A teacher-forced generation whose tokens are not the continuation fed (a problem of its own)."""
    if got.tokens == tuple(fed):
        return []
    position = next((p for p, (a, b) in enumerate(zip(got.tokens, fed)) if a != b), min(len(got.tokens), len(fed)))
    message = (f"request {got.request.describe()}: teacher-forced output scores other tokens than the continuation fed, "
               f"from position {position}\n    scored: {compare.show(got.tokens)}\n    fed:    {compare.show(fed)}")
    return [Problem(index, got, message, frozenset({FailureKind.WRONG_OUTPUT_TYPE}))]


def measure_determinism(repetitions: list[Repetition]) -> dict | None:
    """The later repetitions against the first: ``identical`` when every token and every log-prob (taken and
    top-k) is the same bit for bit, and the largest |log p| difference of a taken token where both runs took
    the same tokens so far. ``None`` for one repetition (or none)."""
    if len(repetitions) < 2:
        return None
    identical, worst = True, 0.0
    first = repetitions[0]
    for other in repetitions[1:]:
        if [(r.name, tuple(r.order)) for r in other] != [(r.name, tuple(r.order)) for r in first]:
            identical = False
        for mine, theirs in zip(first, other):
            for a, b in ((mine.scored, theirs.scored), (mine.generated, theirs.generated)):
                if (a is None) != (b is None) or (a is not None and len(a) != len(b)):
                    identical = False
                for g, h in zip(a or (), b or ()):
                    same, difference = _compare_bits(g, h)
                    identical, worst = identical and same, max(worst, difference)
    return {"runs": len(repetitions), "identical": identical, "max_logprob_difference": worst}


def _compare_bits(g: Generation, h: Generation) -> tuple[bool, float]:
    same = len(g.steps) == len(h.steps) and g.prompt_ids == h.prompt_ids
    worst = 0.0
    for a, b in zip(g.steps, h.steps):
        if a.token != b.token:
            return False, worst  # another past from here: log-probs no longer comparable
        if _bits(a.logprob) != _bits(b.logprob):
            same = False
            difference = abs(a.logprob - b.logprob)
            worst = max(worst, difference if not math.isnan(difference) else math.inf)
        if [t for t, _ in a.top] != [t for t, _ in b.top] or [_bits(lp) for _, lp in a.top] != [_bits(lp) for _, lp in b.top]:
            same = False
    return same, worst


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)
