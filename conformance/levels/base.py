"""What every level of the contract is: a kind of case, with its cases, its run, its repro and its broken result.

The suite judges cases at three levels (design: kernel and wrapper ops, tensor-parallel layers, whole
models), and every front end treats them alike: the session lists every kind's cases and runs each
through its kind, the plugin makes one test per case and marks it by kind, the journal and the
reports read one record per case (``conformance.record.CaseResult``). What differs lives in the
kind's module, and nowhere else: adding a level is one module under ``conformance/levels/`` plus its
cases, added to ``KINDS``.

A kind's ``run`` gets the session (``conformance.session.ConformanceRun``), which holds where the
target runs (``executor``: its worker process; ``tp_executor``: its rank processes) and the referee's
own state; it returns the judged result before expectations, which the session applies to every kind
alike, as it journals every kind alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conformance.record import CaseResult
from conformance.verdict import FailureKind, Outcome

if TYPE_CHECKING:
    from conformance.session import ConformanceRun
    from conformance.targets.facts import TargetFacts


class CaseKind:
    """One level's kind of case. Subclasses set the class attributes and define :meth:`cases` and :meth:`run`."""

    name: str = ""  # the level's name in results.json ("kernel"/"wrapper" for op cases: see level_of)
    markers: dict[str, str] = {}  # the pytest markers its cases carry, with what each means
    result_type: type[CaseResult] = CaseResult
    uses_worker: bool = True  # whether its cases run in the target's worker process (the session starts it early)
    # ``module:function`` of what the target's process runs for one case of this level: ``half(executor, request)``
    # returns the answer as data (``conformance.isolation.local``); the level reads it back, checked, in the referee
    target_half: str = ""

    def owns(self, case: Any) -> bool:
        """Whether ``case`` is one of this kind's."""
        raise NotImplementedError

    def cases(self, profile: str, seed: int) -> list[tuple[str, Any]]:
        """``(case_id, case)`` of every case of the profile at this level, in a fixed order."""
        raise NotImplementedError

    def marks(self, case: Any) -> tuple[str, ...]:
        """The markers of one case (a subset of ``markers``)."""
        return tuple(self.markers)

    def unsupported_reason(self, facts: TargetFacts, case: Any) -> str | None:
        """Why the target does not run ``case``, from its facts alone, or None (it may: its process says).
        The session asks before :meth:`run`, so a case refused here starts no process and loads nothing."""
        return None

    def run(self, run: ConformanceRun, case_id: str, case: Any, values: Any = None) -> CaseResult:
        """The judged result of one case (expectations not applied yet)."""
        raise NotImplementedError

    def broken(self, case_id: str, case: Any, kind: FailureKind, message: str, seconds: float = 0.0,
               traceback: str | None = None) -> CaseResult:
        """The result of a case that did not return (its worker died or hung, or could not load the target):
        outcome *broken*. ``traceback``: what the target raised, formatted in its process, where it raised
        (loading it); a crash or a hang raised nothing and has none."""
        return self.result_type(case_id, case, Outcome.BROKEN, message, features=self.features(case), seconds=seconds, kinds=(kind,),
                                traceback=traceback)

    def features(self, case: Any) -> frozenset[str]:
        return case.features()

    def after_failure(self, run: ConformanceRun, result: CaseResult, values: Any = None) -> dict | None:
        """For a failing, broken or known-failing result: set its ``repro`` (and ``replay``); return the
        record's ``shrunk`` entry where the kind shrinks failures. By default the repro reruns the one test."""
        result.repro = f"pytest '{run.test_node_id(result.case_id)}' --target={run.target_name}" + (f" --seed={run.seed}" if run.seed else "")
        return None
