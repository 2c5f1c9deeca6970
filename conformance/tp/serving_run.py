"""Running a tensor-parallel serving case on a target's ranks and judging it: what the serving level calls.

The referee draws every step's tensors here (``conformance.tp.serving_values``), hands them to the ranks of
the executor's pool in one request (``conformance.tp.serving_rank`` runs it on each rank), reads every
rank's answer as data and judges each step (``conformance.tp.serving_judgement``). A rank that raises,
dies or hangs ends the case as a layer case's does (``conformance.tp.pool``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conformance.digest import tensors_digest
from conformance.serving.judgement import sequence_verdict
from conformance.targets.facts import TargetFacts
from conformance.verdict import Outcome

from .layer_wire import read_served, serving_limits, serving_request
from .pool import RankFailure
from .run import TPExecutor, TPResult, unsupported_reason
from .serving_case import TPServingCase
from .serving_judgement import judge_tp_steps
from .serving_values import named_tensors, request_tensors
from .values import LayerTensors

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


def serve_on_ranks(executor: TPExecutor, case: TPServingCase) -> TPServingResult:
    """The judged result of ``case`` on ``executor``'s ranks; ``ValueError`` where its ranks cannot be placed."""
    return executor.placed(case, tp_serving_unsupported(executor.facts, case), lambda _, placement: _served(executor, case, placement),
                           TPServingResult)


def inputs_digest(initial: LayerTensors, steps: list[LayerTensors]) -> str:
    """The digest of a case's inputs: the buffers' first contents and every step's unsharded layer."""
    return tensors_digest(named_tensors(initial, steps))


def _served(executor: TPExecutor, case: TPServingCase, placement) -> TPServingResult:
    features = case.features()
    started = time.perf_counter()
    pool = executor.started_pool(case, placement, TPServingResult)
    if isinstance(pool, TPResult):
        return pool
    initial, steps = request_tensors(case)  # drawn here, the referee's process, once: handed to the ranks, then judged
    digest = inputs_digest(initial, steps)
    try:
        answers = pool.call(case.case_id, serving_request(case, initial, steps), serving_limits(case, initial),
                            lambda data, rank: read_served(data, rank, case), serving_timeout(executor.case_timeout, case))
    except RankFailure as failure:
        if failure.kind is None:
            return TPServingResult(case.case_id, case, Outcome.NOT_SUPPORTED, failure.message, features=features)
        return TPServingResult(case.case_id, case, Outcome.BROKEN, failure.message, features=features,
                               seconds=time.perf_counter() - started, kinds=(failure.kind,), failing_ranks=failure.ranks,
                               traceback=failure.traceback, raised=failure.raised, inputs_digest=digest)
    judged = judge_tp_steps(case, initial, steps, answers)
    outcome, message, measurement, first = sequence_verdict(case, judged, answers[0].graphs)
    served = first.served if first is not None else None
    return TPServingResult(case.case_id, case, outcome, message, measurement, features, time.perf_counter() - started,
                           served.failing_slots if served else (), kinds=first.kinds if first is not None else (),
                           failing_ranks=served.failing_ranks if served else (), inputs_digest=digest)
