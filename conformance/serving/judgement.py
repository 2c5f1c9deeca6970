"""The referee's half of a serving case: each step's real rows, the rows past the batch, and what the step fed on.

Per step, from the persistent buffers the target's half handed back (``conformance.serving.driver``):

* **the real rows** are the step's batch as an op case: judged by the op level's verdict
  (``conformance.referee.judge_run``: the float64 oracle, the error budget, the written region, the
  systematic and precision rules) on those rows alone;
* **the rows the step was given past its real ones** (padding to a captured size) may hold anything:
  vLLM leaves them unspecified;
* **the output's rows past the step's rows** must keep, bit for bit, what they held before the step;
* **every input** (activations, routing, stacks, per-slot flags) must be as the step wrote it, in every
  row, padded ones included.

A step whose real rows fail is judged again on the same batch called fresh (one op call on fresh
tensors): when that passes, the failure is the state's (``stale state``: what capture froze, what an
earlier step left, metadata written where a graph does not read); when it fails too, the op is wrong
whatever the serving, and the step's own kinds say how.
"""

from __future__ import annotations

import torch

from conformance.ops import OP_SPECS
from conformance.referee import Oracle, RunJudgement, judge_run, same_bits
from conformance.target_call import handed_tensors
from conformance.verdict import FailureKind, Outcome
from conformance.verdict.failure_kind import ordered

from .case import ServingCase
from .driver import ServedRun
from .values import ROW_VALUES, padded_rows

Tensors = dict[str, torch.Tensor]


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bits (NaN payloads and zero signs included)."""
    return same_bits({"t": a}, {"t": b})


class StepJudgement:
    """One step's verdict: ``passed``, its ``details`` and ``kinds``, the worst ``measurement``, failing slots."""

    def __init__(self, index: int, served: RunJudgement | None, problems: list[str], kinds: list[FailureKind]) -> None:
        self.index = index
        self.served = served
        self.problems = problems
        self.kinds = tuple(ordered(kinds))

    @property
    def passed(self) -> bool:
        return not self.kinds


def describe_step(case: ServingCase, index: int) -> str:
    step = case.steps[index]
    where = f"step {index + 1} of {len(case.steps)} ({'prefill' if step.is_prefill else 'decode'}, {step.num_tokens} real row(s)"
    if step.mode == "eager":
        return where + ", eager)"
    size, count = case.graphs[step.graph]
    graph = f"the graph of size {size} captured for {count} active adapter(s)"
    if step.mode == "capture":
        return where + f", capturing {graph})"
    return where + f" of {step.rows}, replaying {graph})"


def judge_step(case: ServingCase, index: int, values: Tensors, before: Tensors, after: Tensors, fresh: Tensors,
               given: int) -> StepJudgement:
    """Step ``index`` of ``case`` (see the module docstring). ``before``: the persistent buffers as the referee
    knows them before the step, with the step's batch written; ``after``: as the target handed them back;
    ``given``: the rows the layer got (the step's size, or its real tokens where it ran unpadded)."""
    spec, step_case = OP_SPECS[case.op], case.step_case(index)
    problems: list[str] = []
    kinds: list[FailureKind] = []
    for name, buffer in after.items():
        expected = before[name]
        if buffer.shape != expected.shape or buffer.dtype != expected.dtype:
            problems.append(f"the persistent {name!r} came back {tuple(buffer.shape)} {buffer.dtype}, not {tuple(expected.shape)} {expected.dtype}")
            kinds.append(FailureKind.WRONG_OUTPUT_TYPE)
            return StepJudgement(index, None, problems, kinds)
    output = spec.output
    rows = padded_rows(values, output, case.steps[index].num_tokens, given)
    if not equal_bits(after[output][rows:], before[output][rows:]):
        changed = (after[output][rows:] != before[output][rows:]).any(dim=tuple(range(1, after[output].dim()))).nonzero().flatten()
        problems.append(f"wrote row(s) {[int(r) + rows for r in changed[:6]]} of the persistent output, past the {rows} row(s) "
                        f"the step was given")
        kinds.append(FailureKind.STALE_STATE)
    modified = [name for name in after if name != output and not equal_bits(after[name], before[name])]
    if modified:
        problems.append(f"modified the persistent input(s) {modified} (rows past the batch included)")
        kinds.append(FailureKind.MODIFIED_INPUT)
    # the real rows, as the op case of the batch
    expected = handed_tensors(spec, step_case, values)
    seen = {name: (after[name][: values[name].size(0)] if name in ROW_VALUES else after[name]) if name in after else tensor
            for name, tensor in expected.items()}
    oracle = Oracle.of(spec, step_case, values) if spec.check is None else None
    served = judge_run(spec, step_case, values, expected, seen, oracle)
    if not served.passed:
        called_fresh = judge_run(spec, step_case, values, expected, fresh, oracle)
        if called_fresh.passed:
            problems.append("; ".join(served.details) + " (the same batch called fresh passes)")
            kinds.append(FailureKind.STALE_STATE)
        else:
            problems.append("; ".join(served.details) + " (called fresh, the batch fails too: "
                            + "; ".join(called_fresh.details) + ")")
            kinds.extend(served.kinds)
    return StepJudgement(index, served, problems, kinds)


def expected_before(case: ServingCase, index: int, state: Tensors, values: Tensors) -> Tensors:
    """The persistent buffers before step ``index``: ``state`` (after the previous step) with the step's batch and
    resident stacks written, as the target's half writes them."""
    before = {name: tensor.clone() for name, tensor in state.items()}
    for name, tensor in values.items():
        if name in before and name in ROW_VALUES:
            before[name][: tensor.size(0)] = tensor
        elif name in before:
            before[name] = tensor.clone()
    return before


def judge_steps(case: ServingCase, initial: Tensors, steps: list[Tensors], run: ServedRun) -> list[StepJudgement]:
    """Every step in order; the state carried from one to the next is what the target handed back, except the
    inputs, which carry what the referee wrote (a target that modifies one fails that step, not every later one)."""
    output = OP_SPECS[case.op].output
    state = dict(initial)
    for name, tensor in steps[0].items():
        if name not in state:
            state[name] = torch.zeros_like(tensor)
    judged = []
    for index, values in enumerate(steps):
        before = expected_before(case, index, state, values)
        judged.append(judge_step(case, index, values, before, run.steps[index], run.fresh[index], run.rows[index]))
        state = {**before, output: run.steps[index][output]}
    return judged


def sequence_verdict(case, judged: list[StepJudgement], graphs: str):
    """``(outcome, message, measurement, first failing step or None)`` of a serving case from its steps' judgements:
    its first failing step's problems, with the worst measurement over its steps; a pass says how the steps ran."""

    measurements = [j.served.measurement for j in judged if j.served is not None and j.served.measurement is not None]
    measurement = max(measurements, key=lambda m: m.budget_ratio) if measurements else None
    failing = [j for j in judged if not j.passed]
    if not failing:
        return Outcome.PASS, f"{len(case.steps)} steps served: {graphs}", measurement, None
    first = failing[0]
    others = f" ({len(failing) - 1} later step(s) fail too)" if len(failing) > 1 else ""
    return (Outcome.FAIL, f"{describe_step(case, first.index)}: {'; '.join(first.problems)}{others}; {graphs}", measurement, first)
