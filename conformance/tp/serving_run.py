"""Running a tensor-parallel serving case on a target's ranks and judging it: what the serving level calls.

The referee draws every step's tensors here (``conformance.tp.serving_values``), hands them to the ranks of
the executor's pool in one request (``conformance.tp.serving_rank`` runs it on each rank), reads every
rank's answer as data and judges each step (``conformance.tp.serving_judgement``). A rank that raises,
dies or hangs ends the case as a layer case's does (``conformance.tp.pool``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conformance.serving.judgement import sequence_verdict
from conformance.targets.facts import TargetFacts
from conformance.verdict import Outcome

from .layer_wire import read_served, serving_limits, serving_request
from .pool import RankFailure
from .run import TPExecutor, TPResult, unsupported_reason
from .serving_case import TPServingCase
from .serving_judgement import judge_tp_steps
from .serving_values import request_tensors

LEVEL = "serving"


@dataclass
class TPServingResult(TPResult):
    """A tensor-parallel serving case's result: a layer case's record (failing ranks, placement) at level serving."""

    case: TPServingCase

    @property
    def level(self) -> str:
        return LEVEL


def tp_serving_unsupported(facts: TargetFacts, case: TPServingCase) -> str | None:
    """Why the target does not serve ``case``: what it lacks to run the layer's batches as layer cases."""
    return unsupported_reason(facts, case.step_case(0))


def serving_timeout(case_timeout: float | None, case: TPServingCase) -> float | None:
    """How long a serving case may run on its ranks: a layer case's timeout per four steps (a step captures or
    replays up to two pieces on every rank, and calls its batch fresh once), at least one."""
    return None if case_timeout is None else case_timeout * max(1, len(case.steps) // 4)


def serve_on_ranks(executor: TPExecutor, case: TPServingCase, digest: str | None = None) -> TPServingResult:
    """The judged result of ``case`` on ``executor``'s ranks; ``ValueError`` where its ranks cannot be placed."""
    features = case.features()
    reason = tp_serving_unsupported(executor.facts, case)
    if reason:
        return TPServingResult(case.case_id, case, Outcome.NOT_SUPPORTED, reason, features=features)
    placement = executor.placement(case.tp_size)
    started = time.perf_counter()
    pool = executor.started_pool(case, placement, TPServingResult)
    if isinstance(pool, TPResult):
        pool.placement = placement.to_json()
        return pool
    initial, steps = request_tensors(case)
    try:
        answers = pool.call(case.case_id, serving_request(case, initial, steps), serving_limits(case, initial),
                            lambda data, rank: read_served(data, rank, case), serving_timeout(executor.case_timeout, case))
    except RankFailure as failure:
        seconds = time.perf_counter() - started
        if failure.kind is None:
            result = TPServingResult(case.case_id, case, Outcome.NOT_SUPPORTED, failure.message, features=features)
        else:
            result = TPServingResult(case.case_id, case, Outcome.BROKEN, failure.message, features=features, seconds=seconds,
                                     kinds=(failure.kind,), failing_ranks=failure.ranks, traceback=failure.traceback,
                                     raised=failure.raised, inputs_digest=digest)
        result.placement = placement.to_json()
        return result
    judged = judge_tp_steps(case, initial, steps, answers)
    graphs = answers[0].graphs
    outcome, message, measurement, first = sequence_verdict(case, judged, graphs)
    served = first.served if first is not None else None
    result = TPServingResult(case.case_id, case, outcome, message, measurement, features, time.perf_counter() - started,
                             served.failing_slots if served else (), kinds=first.kinds if first is not None else (),
                             failing_ranks=served.failing_ranks if served else (), inputs_digest=digest)
    result.placement = placement.to_json()
    if placement.shared:
        result.message += f" ({placement.label})"
    return result
