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
from conformance.text import describe_exception, safe_text


class LocalExecutor:
    """One target, loaded once, and the per-process state built around it on first use."""

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name
        self.target = load(target_name)
        self._e2e_runner = None  # conformance.e2e.run.E2ETargetRunner, built by the first end-to-end case

    def facts(self) -> TargetFacts:
        return facts_of(type(self.target))

    def device_description(self) -> dict:
        """Which device this process runs its cases on (name and driver): the target's own words where it
        has them (``describe_device()``, for a device type the suite has no reader for), else the suite's."""
        describe = getattr(self.target, "describe_device", None)
        if callable(describe):
            try:
                return {key: safe_text(value) for key, value in dict(describe()).items()}
            except Exception as exc:  # noqa: BLE001 - a fingerprint must never fail the run it describes
                return {"device": f"{self.target.device.type}: describe_device() raised {describe_exception(exc)}", "driver": "unknown"}
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
