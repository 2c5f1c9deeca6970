"""Each workload measured in a process of its own, so that no measurement sees another's memory.

A fork server whose parent has imported ``preload`` (torch, the implementations) starts one child per
workload, so the imports cost nothing per measurement and the child's peak memory is that workload's
alone. A workload whose implementation raises is a result (``{"error": …}``), not the end of the run.
This module imports nothing heavy: the parent stays light.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable


def measure_each(todo: list, threads: int, child: Callable, preload: str, label: str, describe: Callable, log=print) -> list:
    """``[(workload, result)]`` for the ``(workload, _)`` pairs of ``todo``; ``child((workload, threads))``
    (a module-level function, so it pickles) measures one; the log line reads ``[label i/n] describe(w): result``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([preload])
    results = []
    for i, (w, _) in enumerate(todo, 1):
        with context.Pool(1, maxtasksperchild=1) as pool:
            try:
                result = pool.apply(child, ((w, threads),))
            except Exception as exc:  # noqa: BLE001 - a broken implementation is a result, not a crash
                result = {"error": f"{type(exc).__name__}: {exc}"}
        results.append((w, result))
        log(f"[{label} {i}/{len(todo)}] {describe(w)}: {result}")
    return results
