"""End-to-end model cases (design level 4): greedy generation of small decoders with mixed adapters.

The referee (``conformance.e2e``'s float64 reference decoder and comparisons) lives here, in the
referee's process: it computes the reference continuations, the target's worker produces the target's
generations for them (``produce_e2e``), and the referee judges what came back. Whether the target runs a
case at all is decided here from its facts (its dtypes, its generation engine, the wrapper methods the
decoder calls for the case's model), before the worker starts or a fixture model loads.
"""

from __future__ import annotations

import time

from conformance.e2e.cases import E2ECase, e2e_cases
from conformance.e2e.production import read_production
from conformance.e2e.run import E2EResult
from conformance.e2e.target_runner import e2e_unsupported_reason
from conformance.errors import RunError
from conformance.levels.context import LevelContext
from conformance.optional import e2e_missing_reason
from conformance.record import CaseResult
from conformance.targets.facts import TargetFacts
from conformance.wire import Limits

from .base import BREAKDOWNS, CaseKind

FIXTURE_ERRORS = (FileNotFoundError, ValueError, ImportError)  # the fixtures, not the target: a usage error
PRODUCTION_LIMITS = Limits(tensor_bytes=0, tensors=0)  # tokens and log-probabilities: JSON only


class ModelKind(CaseKind):
    name = "model"
    target_half = "conformance.e2e.target_runner:serve"
    markers = {"e2e": "an end-to-end generation case (design level 4, the model)"}
    result_type = E2EResult

    def owns(self, case) -> bool:
        return isinstance(case, E2ECase)

    def cases(self, profile: str, seed: int) -> list[tuple[str, E2ECase]]:
        return [(case.case_id, case) for case in e2e_cases(profile)]

    def case_from_json(self, data: dict) -> E2ECase:
        return E2ECase.from_json(data)

    def unsupported_reason(self, facts: TargetFacts, case: E2ECase) -> str | None:
        """``e2e_unsupported_reason`` from the facts: the worker asks it again, of the loaded target, and agrees.
        First, whether this environment can judge an end-to-end case at all (``conformance.optional``): a missing
        optional package makes the cases not supported, with the reason, rather than errors."""
        return e2e_missing_reason() or e2e_unsupported_reason(
            case, facts.name, facts.generation_engine, facts.claims(case.dtype), facts.methods
        )

    def run(self, context: LevelContext, case_id: str, case: E2ECase, values=None) -> CaseResult:
        try:
            referee = context.e2e_referee
            continuations = referee.continuations(case)
        except FIXTURE_ERRORS as exc:
            raise RunError(str(exc)) from None
        started = time.perf_counter()
        try:
            request = {"case": case.to_json(), "continuations": continuations, "runs": context.repeat}
            production = context.executor.call(self.name, self.target_half, case_id, request, limits=PRODUCTION_LIMITS,
                                           parse=lambda data: read_production(data, case, context.repeat))
        except BREAKDOWNS as exc:
            return self.broken_by(exc, case_id, case, time.perf_counter() - started)
        except FIXTURE_ERRORS as exc:
            raise RunError(str(exc)) from None
        return referee.judge(case, production)


MODEL = ModelKind()
