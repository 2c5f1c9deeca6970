"""Where cases run: in a worker process of their own (the default), or in the pytest process.

``--isolation=process`` (default): :class:`IsolatedExecutor`, a worker process per pytest process
that survives nothing but also takes nothing down: a target that crashes or hangs costs one case,
recorded *broken* with kind ``crashed`` or ``timed out`` (``--case-timeout``), and the run goes on.
``--isolation=none``: :class:`LocalExecutor`, in-process, for a debugger or a profiler; no timeout.
Both offer the same calls, the target's half of each case (the referee stays in the caller's process):
``call_target``, ``produce_e2e``, ``facts``, ``device_description``, ``close``.
"""

import importlib

ISOLATION_MODES = ("process", "none")

# Loaded on first use, so that the leaf modules (worker, protocol) load alone in a worker or rank process.
_EXPORTS = {
    "LocalExecutor": ".local", "IsolatedExecutor": ".process", "TargetLoadError": ".process",
    "Breakdown": ".worker", "describe_exit": ".worker",
}  # fmt: skip


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ISOLATION_MODES", "Breakdown", "IsolatedExecutor", "LocalExecutor", "TargetLoadError", "describe_exit"]
