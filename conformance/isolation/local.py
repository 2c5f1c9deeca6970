"""The target's half of every case, in this process: what a worker process runs for its parent.

:class:`conformance.isolation.process.IsolatedExecutor` runs a ``LocalExecutor`` in a worker process of
its own and forwards each call to it, so that a target that crashes or hangs takes only that process
with it, and so that nothing the target does to its process reaches the referee in the parent;
``--isolation=none`` uses a ``LocalExecutor`` in the pytest process itself (for a debugger or a
profiler, at the price of both protections). It only runs the target and hands back what happened, as
data: it never judges.

One call for every level: :meth:`LocalExecutor.call` ``(level, half, case_id, request)`` runs that
level's *target half*, a function ``half(executor, request) -> data`` named ``module:function`` (each
level states its own: ``conformance.levels.base.CaseKind.target_half``), with the loaded target as
``executor.target`` and a per-level dict ``executor.state(level)`` for what the half keeps between cases
(an engine, a loaded model). The request and the answer are data (``conformance.wire``): JSON and
tensors, the same in this process as across a pipe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from conformance.report.fingerprint import device_description
from conformance.targets import load
from conformance.targets.facts import TargetFacts, facts_of
from conformance.text import describe_exception, safe_text
from conformance.wire import WireError

from .output import TargetOutput, WarningSeen, collecting_warnings, kept_warnings
from .worker import WorkerProcess

TargetHalf = Callable[["LocalExecutor", Any], Any]


def resolve_half(path: str) -> TargetHalf:
    """The function ``module:function`` names (a level's target half)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class LocalExecutor:
    """One target, loaded once, the levels' target halves, and the per-process state they keep."""

    def __init__(self, target_name: str) -> None:
        self.target_name = target_name
        self.target = load(target_name)
        self._resolved: dict[str, TargetHalf] = {}
        self._state: dict[str, dict] = {}
        self._warnings: list[WarningSeen] = []  # raised by the calls since take_warnings

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

    def state(self, level: str) -> dict:
        """What ``level``'s target half keeps in this process between cases (made empty on first use)."""
        return self._state.setdefault(level, {})

    def call(self, level: str, half: str, case_id: str, request: Any, *, parse: Callable[[Any], Any] | None = None,
             doing: str = "running this case", **_) -> Any:
        """``level``'s target half (``half``, ``module:function``) on ``request``: its answer, read by ``parse`` as the
        isolated executor reads it (a ``WireError`` from it is a :class:`~conformance.isolation.worker.Breakdown`, kind
        ``malformed reply``). ``case_id`` and ``limits`` are the pipe's: in this process the answer is the half's own."""
        if half not in self._resolved:
            self._resolved[half] = resolve_half(half)
        with collecting_warnings(self._warnings):
            data = self._resolved[half](self, request)
        if parse is None:
            return data
        try:
            return parse(data)
        except WireError as exc:
            raise WorkerProcess.refused(str(exc), doing, stopped=False) from None

    def take_warnings(self) -> tuple[tuple[WarningSeen, ...], int]:
        """The warnings the calls raised since the last time, the most frequent ones, and how many distinct others
        (``conformance.isolation.output.kept_warnings``: what a reply carries); forget them."""
        seen, self._warnings = self._warnings, []
        return kept_warnings(seen)

    def take_output(self) -> TargetOutput:
        """What the target said since the last time, for the case's record: its warnings (in this process its prints
        are the caller's own output, which pytest captures)."""
        output = TargetOutput()
        output.add_warnings(*self.take_warnings())
        return output

    def close(self) -> None:
        """Nothing to release: the process's own end frees the target."""
