"""Running cases in this process: the target, the end-to-end runner and shrinking, side by side.

This is what actually runs a case. :class:`conformance.isolation.process.IsolatedExecutor` runs a
``LocalExecutor`` in a worker process of its own and forwards each call to it, so that a target that
crashes or hangs takes only that process with it; ``--isolation=none`` uses a ``LocalExecutor`` in the
pytest process itself (for a debugger or a profiler, at the price of that protection).
"""

from __future__ import annotations

from conformance.cases.case import Case
from conformance.report.fingerprint import device_description
from conformance.runner import CaseResult, Tensors, run_case
from conformance.targets import load


class LocalExecutor:
    """One target, loaded once, and the per-process state built around it on first use."""

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name
        self.target = load(target_name)
        self._e2e_runner = None  # conformance.e2e.run.E2ERunner, built by the first end-to-end case

    def device_description(self) -> dict:
        """Which device this process runs its cases on (name and driver)."""
        return device_description(self.target.device.type)

    def run_op(self, case_id: str, case: Case, values: Tensors | None) -> CaseResult:
        return run_case(self.target, case, case_id, values)

    def run_e2e(self, case):
        if self._e2e_runner is None:  # op-only runs never read the fixtures
            from conformance.e2e.run import E2ERunner

            self._e2e_runner = E2ERunner(self.target)
        return self._e2e_runner.run(case)

    def shrink(self, failing: CaseResult, limits) -> Case | None:
        # Hypothesis loads only here: a run never needs it otherwise once its profile's cases are in
        # the disk cache, and its import costs seconds per process (conformance.generator.cache).
        from conformance import hypothesis_profile
        from conformance.shrinking import shrink_failure

        hypothesis_profile.load()
        return shrink_failure(self.target, failing, limits)

    def close(self) -> None:
        """Nothing to release: the process's own end frees the target."""
