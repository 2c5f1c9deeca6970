"""What every level of the contract is: a kind of case, with its cases, its run, its repro and its broken result.

The suite judges cases at three levels (design: kernel and wrapper ops, tensor-parallel layers, whole
models), and every front end treats them alike: the session lists every kind's cases and runs each
through its kind, the plugin makes one test per case and marks it by kind, the journal and the
reports read one record per case (``conformance.record.CaseResult``). What differs lives in the
kind's module, and nowhere else: adding a level is one module under ``conformance/levels/`` plus its
cases, added to ``BUILT_IN_KINDS``, or a package of its own with an entry point (``examples/custom_level``).

A kind's ``run`` gets a :class:`~conformance.levels.context.LevelContext`, not the session: the run's
settings it reads and where the target runs (``executor``: its worker process; ``tp_executor``: its rank
processes), nothing else. It returns the judged result before expectations, which the session applies
to every kind alike, as it journals every kind alike.
"""

from __future__ import annotations

import shlex
from typing import Any

from conformance.digest import json_digest
from conformance.isolation import Breakdown, TargetLoadError
from conformance.levels.context import LevelContext
from conformance.query import file_name
from conformance.record import CaseResult
from conformance.targets.facts import TargetFacts
from conformance.verdict import FailureKind, Outcome

# What a call into the target's process raises when the case did not return: its worker died, hung, sent
# what the wire refuses (Breakdown), or could not load the target (TargetLoadError).
BREAKDOWNS = (Breakdown, TargetLoadError)


def breakdown_message(exc: Exception) -> str:
    """What a worker's death, hang or failed start says (``Breakdown`` / ``TargetLoadError``)."""
    return getattr(exc, "message", None) or str(exc)


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

    def case_from_json(self, data: dict) -> Any:
        """The case ``case.to_json()`` wrote (a frozen case list holds cases so, ``conformance.caselists``);
        ``ValueError`` naming what is wrong with ``data``."""
        raise NotImplementedError(f"the {self.name} level cannot read its cases from JSON: define case_from_json")

    def inputs_digest(self, case: Any) -> str:
        """The digest of the inputs the referee draws for ``case`` (``conformance.digest``), as a frozen case list
        and every result record it. By default the case's JSON: a level whose case is all its inputs."""
        return json_digest(case.to_json())

    def marks(self, case: Any) -> tuple[str, ...]:
        """The markers of one case (a subset of ``markers``)."""
        return tuple(self.markers)

    def unsupported_reason(self, facts: TargetFacts, case: Any) -> str | None:
        """Why the target does not run ``case``, from its facts alone, or None (it may: its process says).
        The session asks before :meth:`run`, so a case refused here starts no process and loads nothing."""
        return None

    def run(self, context: LevelContext, case_id: str, case: Any, values: Any = None) -> CaseResult:
        """The judged result of one case (expectations not applied yet)."""
        raise NotImplementedError

    def broken(self, case_id: str, case: Any, kind: FailureKind, message: str, seconds: float = 0.0,
               traceback: str | None = None, raised: dict[str, str] | None = None) -> CaseResult:
        """The result of a case that did not return (its worker died or hung, or could not load the target):
        outcome *broken*. ``traceback``: what the target raised, formatted in its process, where it raised
        (loading it), and ``raised`` its type and the target's innermost frame; a crash or a hang raised
        nothing and has neither."""
        return self.result_type(case_id, case, Outcome.BROKEN, message, features=self.features(case), seconds=seconds, kinds=(kind,),
                                traceback=traceback, raised=raised)

    def broken_by(self, exc: Exception, case_id: str, case: Any, seconds: float = 0.0) -> CaseResult:
        """The broken result of a case whose call into the target's process raised one of ``BREAKDOWNS``."""
        # a TargetLoadError carries what the target raised while loading; a crash or a hang raised nothing
        return self.broken(case_id, case, exc.kind, breakdown_message(exc), seconds, traceback=getattr(exc, "traceback", None),
                           raised=getattr(exc, "raised", None))

    def features(self, case: Any) -> frozenset[str]:
        return case.features()

    def after_failure(self, context: LevelContext, result: CaseResult, values: Any = None) -> dict | None:
        """For a failing, broken or known-failing result: set its ``repro`` (and ``replay``); return the
        record's ``shrunk`` entry where the kind shrinks failures. By default the repro reruns the one test, on the
        target as the run was given it, into a directory of its own under the run's report dir (``LevelContext.repro_options``)."""
        result.repro = (f"pytest {shlex.quote(context.test_node_id(result.case_id))} --target={shlex.quote(context.target_name)}"
                        + (f" --seed={context.seed}" if context.seed else "") + f" {context.repro_options(file_name(result.case_id))}")
        return None
