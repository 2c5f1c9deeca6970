"""Where cases run: in a worker process of their own (the default), or in the pytest process.

``--isolation=process`` (default): :class:`IsolatedExecutor`, a worker process per pytest process
that survives nothing but also takes nothing down: a target that crashes or hangs costs one case,
recorded *broken* with kind ``crashed`` or ``timed out`` (``--case-timeout``), and the run goes on.
``--isolation=none``: :class:`LocalExecutor`, in-process, for a debugger or a profiler; no timeout.
Both offer the same calls: ``run_op``, ``run_e2e``, ``shrink``, ``device_description``, ``close``.
"""

from .local import LocalExecutor
from .process import Breakdown, IsolatedExecutor, broken_result, describe_exit

ISOLATION_MODES = ("process", "none")

__all__ = ["ISOLATION_MODES", "Breakdown", "IsolatedExecutor", "LocalExecutor", "broken_result", "describe_exit"]
