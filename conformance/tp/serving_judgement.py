"""The referee's half of a tensor-parallel serving case: each step's gathered rows, and every rank's buffers.

Per step, from what every rank handed back (``conformance.tp.layer_wire.RankServed``):

* **the real rows**: rank 0's gathered output of the step, judged as the tensor-parallel case of the same
  batch (``conformance.tp.judgement.judge_output``: the unsharded float64 oracle, the composition's
  baseline, the written region); when it fails, the same batch called fresh on the ranks is judged too:
  passing fresh makes the failure the state's (``stale state``), failing fresh the op's own kinds;
* **each rank's output rows past the rows its layer got** must keep, bit for bit, what they held;
* **each rank's inputs** (its activations in every row, padded ones included, and its stacks) must be as
  the step wrote them (``modified input``, naming the rank).

Failures name the ranks (the columns' owners, as a layer case names them, and the ranks whose buffers
are wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.serving.judgement import StepJudgement, equal_bits
from conformance.verdict import FailureKind

from .judgement import judge_output
from .layer_wire import RankServed
from .serving_case import TPServingCase
from .values import LayerTensors, rank_shard


@dataclass(frozen=True)
class StepVerdict:
    """What a step's result reads of its gathered rows' verdict (``StepJudgement.served``)."""

    measurement: object
    failing_slots: tuple[int, ...] = ()
    failing_slices: tuple[int, ...] = ()
    failing_ranks: tuple[int, ...] = ()


def expected_state(case: TPServingCase, rank: int, before: dict[str, torch.Tensor], step: LayerTensors, tokens: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s buffers once the step's shard is written: ``before`` with the batch in the first ``tokens`` rows
    and the resident adapters' stacks."""
    written = rank_shard(case.layer, step, rank).named()
    state = {name: tensor.clone() for name, tensor in before.items()}
    state["x"][:tokens], state["y"][:tokens] = written.pop("x"), written.pop("y")
    return {**state, **written}


def initial_states(case: TPServingCase, initial: LayerTensors) -> list[dict[str, torch.Tensor]]:
    return [rank_shard(case.layer, initial, rank).named() for rank in range(case.tp_size)]


def _rank_problems(before: dict, after: dict, given: int, rank: int) -> tuple[list[str], list[FailureKind]]:
    """One rank's buffers after a step against ``before`` (the step's shard written): see the module docstring."""
    if set(after) != set(before) or any(after[n].shape != before[n].shape or after[n].dtype != before[n].dtype for n in before):
        described = {name: (tuple(t.shape), str(t.dtype)) for name, t in after.items()}
        return [f"rank {rank}'s persistent buffers came back as {described}"], [FailureKind.WRONG_OUTPUT_TYPE]
    problems, kinds = [], []
    if not equal_bits(after["y"][given:], before["y"][given:]):
        changed = (after["y"][given:] != before["y"][given:]).any(dim=1).nonzero().flatten()
        problems.append(f"rank {rank} wrote row(s) {[int(r) + given for r in changed[:6]]} of its persistent output, past the "
                        f"{given} row(s) its layer was given")
        kinds.append(FailureKind.STALE_STATE)
    modified = [name for name in before if name != "y" and not equal_bits(after[name], before[name])]
    if modified:
        problems.append(f"rank {rank} modified its persistent input(s) {modified} (rows past the batch included)")
        kinds.append(FailureKind.MODIFIED_INPUT)
    return problems, kinds


def _kept(returned: torch.Tensor | None, expected: torch.Tensor) -> torch.Tensor:
    """The output buffer a rank carries into the next step: as it came back, unless it came back another shape."""
    ok = returned is not None and returned.shape == expected.shape and returned.dtype == expected.dtype
    return returned if ok else expected


def judge_tp_steps(case: TPServingCase, initial: LayerTensors, steps: list[LayerTensors], answers: list[RankServed]) -> list[StepJudgement]:
    """Every step in order. The state carried from a step to the next is each rank's output buffer as it came back and
    its inputs as the referee wrote them (a rank that modifies one fails that step, not every later one)."""
    states = initial_states(case, initial)
    judged = []
    for index, values in enumerate(steps):
        step, step_case = case.steps[index], case.step_case(index)
        problems: list[str] = []
        kinds: list[FailureKind] = []
        ranks: set[int] = set()
        befores = [expected_state(case, rank, states[rank], values, step.num_tokens) for rank in range(case.tp_size)]
        for rank, (before, answer) in enumerate(zip(befores, answers)):
            found, found_kinds = _rank_problems(before, answer.states[index], answer.rows[index], rank)
            problems += found
            kinds += found_kinds
            ranks |= {rank} if found else set()
        verdict, message, slots, failing, verdict_kinds, _ = judge_output(step_case, answers[0].outputs[index], values)
        if not verdict.passed:
            fresh, fresh_message, *_ = judge_output(step_case, answers[0].fresh[index], values)
            if fresh.passed:
                problems.append(f"{message} (the same batch called fresh passes)")
                kinds.append(FailureKind.STALE_STATE)
            else:
                problems.append(f"{message} (called fresh, the batch fails too: {fresh_message})")
                kinds.extend(verdict_kinds)
            ranks |= set(failing)
        served = StepVerdict(verdict.measurement, tuple(slots), (), tuple(sorted(ranks)))
        judged.append(StepJudgement(index, served, problems, kinds))
        states = [{**before, "y": _kept(answer.states[index].get("y"), before["y"])} for before, answer in zip(befores, answers)]
    return judged
