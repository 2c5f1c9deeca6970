"""The target's half of every case, in this process: what a worker process runs for its parent.

:class:`conformance.isolation.process.IsolatedExecutor` runs a ``LocalExecutor`` in a worker process of
its own and forwards each call to it, so that a target that crashes or hangs takes only that process
with it, and so that nothing the target does to its process reaches the referee in the parent;
``--isolation=none`` uses a ``LocalExecutor`` in the pytest process itself (for a debugger or a
profiler, at the price of both protections). It only runs the target and hands back what happened
(``conformance.target_call``, ``conformance.e2e``): it never judges.
"""

from __future__ import annotations

from conformance.cases.case import Case
from conformance.report.fingerprint import device_description
from conformance.target_call import TargetCall, Tensors, call_target
from conformance.targets import load
from conformance.targets.facts import TargetFacts, facts_of


class LocalExecutor:
    """One target, loaded once, and the per-process state built around it on first use."""

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name
        self.target = load(target_name)
        self._e2e_runner = None  # conformance.e2e.run.E2ETargetRunner, built by the first end-to-end case

    def facts(self) -> TargetFacts:
        return facts_of(type(self.target))

    def device_description(self) -> dict:
        """Which device this process runs its cases on (name and driver)."""
        return device_description(self.target.device.type)

    def call_target(self, case: Case, values: Tensors, runs: int) -> TargetCall:
        return call_target(self.target, case, values, runs)

    def produce_e2e(self, case, continuations, runs: int):
        if self._e2e_runner is None:  # op-only runs never read the fixtures
            from conformance.e2e.run import E2ETargetRunner

            self._e2e_runner = E2ETargetRunner(self.target)
        return self._e2e_runner.produce(case, continuations, runs=runs)

    def close(self) -> None:
        """Nothing to release: the process's own end frees the target."""
