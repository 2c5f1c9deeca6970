"""Serving cases (``serving:…``): one target instance, persistent buffers, captured graphs, step after step.

The values are drawn here, in the referee's process (``conformance.serving.values``); the target's worker
drives a new instance of the target through the steps and calls each step's batch fresh
(``conformance.serving.driver``); every step is judged here (``conformance.serving.judgement``). A
tensor-parallel serving case runs on the target's rank processes instead, each rank serving its shard
(``conformance.tp.serving_run``). The
case's result is its first failing step's, with the worst measurement over its steps; a pass says how
the target ran the steps (captured graphs, or eagerly where it captures nothing).
"""

from __future__ import annotations

import time

from conformance.cases.features import case_features
from conformance.digest import tensors_digest
from conformance.errors import RunError
from conformance.levels.context import LevelContext
from conformance.record import CaseResult
from conformance.serving.case import ServingCase
from conformance.serving.driver import ServedRun
from conformance.serving.judgement import describe_step, judge_steps, sequence_verdict
from conformance.serving.scenarios import serving_cases
from conformance.serving.values import request_values
from conformance.targets.facts import TargetFacts
from conformance.tp.serving_case import TPServingCase, is_tp_serving_json
from conformance.tp.serving_cases import tp_serving_cases
from conformance.tp.serving_run import inputs_digest as tp_inputs_digest
from conformance.tp.serving_run import serve_on_ranks, tp_serving_unsupported
from conformance.tp.serving_values import request_tensors
from conformance.verdict import FailureKind, Outcome
from conformance.wire import Limits, WireError, from_data

from .base import BREAKDOWNS, CaseKind

LEVEL = "serving"


def values_digest(initial: dict, steps: list[dict]) -> str:
    """The digest of a serving case's inputs: the buffers' first contents and every step's values."""
    return tensors_digest({**{f"initial.{k}": v for k, v in initial.items()},
                           **{f"step{i}.{k}": v for i, values in enumerate(steps) for k, v in values.items()}})


class ServingResult(CaseResult):
    case: ServingCase

    @property
    def level(self) -> str:
        return LEVEL


def reply_limits(initial: dict, steps: list[dict]) -> Limits:
    """Every persistent buffer after every step, and every handed tensor of every fresh call, at most twice their size."""
    buffers = sum(t.numel() * t.element_size() for t in initial.values()) + sum(
        t.numel() * t.element_size() for name, t in steps[0].items() if name not in initial)
    handed = sum(sum(t.numel() * t.element_size() for t in values.values()) for values in steps)
    count = len(steps) * (len(initial) + len(steps[0]) * 2 + 8)
    return Limits(tensor_bytes=2 * (len(steps) * buffers + handed) + (1 << 20), tensors=count)


def read_answer(data, case: ServingCase) -> ServedRun:
    run = from_data(ServedRun, data, "the serving case's answer")
    steps = len(case.steps)
    if run.status == "ran" and not (len(run.steps) == len(run.fresh) == len(run.rows) == steps):
        raise WireError(f"the serving answer ran {len(run.steps)} step(s), {len(run.fresh)} fresh call(s) and gave "
                        f"{len(run.rows)} row count(s), not {steps} of each")
    for step, rows in zip(case.steps, run.rows):
        if rows not in (step.rows, step.num_tokens):  # padded to the step's size, or unpadded: nothing else
            raise WireError(f"the serving answer says a step of {step.num_tokens} token(s) padded to {step.rows} ran on {rows} rows")
    if run.status == "not_supported" and (run.steps or run.fresh):
        raise WireError("the serving answer is 'not supported' yet holds steps")
    return run


class ServingKind(CaseKind):
    name = LEVEL
    markers = {LEVEL: "a serving case: one target instance driven step after step on persistent buffers, padded "
                      "batches and captured graphs (conformance.serving)"}
    result_type = ServingResult
    target_half = "conformance.serving.driver:serve"

    def owns(self, case) -> bool:
        return isinstance(case, (ServingCase, TPServingCase))

    def features(self, case: ServingCase | TPServingCase) -> frozenset[str]:
        """The serving features (family, graph policy, step modes, padding) and every feature of every step's batch
        as an op case (or a layer case, on ranks): a serving case exercises what its batches exercise (a known
        failure of the op matches it)."""
        if isinstance(case, TPServingCase):
            return case.features()
        return case.features().union(*(case_features(case.step_case(index)) for index in range(len(case.steps))))

    def cases(self, profile: str, seed: int) -> list[tuple[str, ServingCase | TPServingCase]]:
        """The one-process cases, then the tensor-parallel ones (by TP size: a rank pool starts once per size)."""
        cases = serving_cases(profile, seed) + tp_serving_cases(profile, seed)
        return [(case.case_id, case) for case in cases]

    def case_from_json(self, data: dict) -> ServingCase | TPServingCase:
        return TPServingCase.from_json(data) if is_tp_serving_json(data) else ServingCase.from_json(data)

    def inputs_digest(self, case: ServingCase | TPServingCase) -> str:
        if isinstance(case, TPServingCase):
            return tp_inputs_digest(*request_tensors(case))
        return values_digest(*request_values(case))

    def unsupported_reason(self, facts: TargetFacts, case: ServingCase | TPServingCase) -> str | None:
        if isinstance(case, TPServingCase):
            return tp_serving_unsupported(facts, case)
        if not facts.defines(case.op):
            return facts.why_not_implemented.get(case.op, f"{facts.name} does not implement {case.op}")
        if not facts.claims(case.dtype):
            return f"{facts.name} does not support {case.dtype}"
        return None

    def run(self, context: LevelContext, case_id: str, case: ServingCase | TPServingCase, values=None) -> CaseResult:
        if isinstance(case, TPServingCase):
            try:
                return serve_on_ranks(context.tp_executor, case)
            except ValueError as exc:  # --devices cannot give every rank a device: the run's options, not the target
                raise RunError(str(exc)) from None
        initial, steps = request_values(case) if values is None else values
        request = {"case": case.to_json(), "initial": initial, "steps": steps}
        started = time.perf_counter()
        try:
            run = context.executor.call(self.name, self.target_half, case_id, request, limits=reply_limits(initial, steps),
                                        parse=lambda data: read_answer(data, case))
        except BREAKDOWNS as exc:
            return self.broken_by(exc, case_id, case, time.perf_counter() - started)
        result = self.judged(case_id, case, initial, steps, run)
        result.seconds = time.perf_counter() - started
        return result

    def judged(self, case_id: str, case: ServingCase, initial, steps, run: ServedRun) -> ServingResult:
        features = self.features(case)
        if run.status == "not_supported":
            return ServingResult(case_id, case, Outcome.NOT_SUPPORTED, run.message, features=features)
        digest = values_digest(initial, steps)
        if run.status == "raised":
            where = (describe_step(case, run.raised_in) if run.raised_in is not None and run.raised_in < len(case.steps)
                     else f"the fresh call of step {run.raised_in - len(case.steps) + 1}" if run.raised_in is not None else "serving")
            return ServingResult(case_id, case, Outcome.BROKEN, f"{where} raised: {run.message}", features=features,
                                 kinds=(FailureKind.RAISED,), traceback=run.traceback, raised=run.raised, inputs_digest=digest)
        judged = judge_steps(case, initial, steps, run)
        outcome, message, measurement, first = sequence_verdict(case, judged, run.graphs)
        served = first.served if first is not None else None
        return ServingResult(case_id, case, outcome, message, measurement, features,
                             failing_slots=served.failing_slots if served else (), failing_slices=served.failing_slices if served else (),
                             kinds=first.kinds if first is not None else (), inputs_digest=digest)


SERVING = ServingKind()

__all__ = ["LEVEL", "SERVING", "ServingKind", "ServingResult"]
