"""Time and peak extra memory of one workload, measured in the process that calls ``measure``.

Memory: Linux's resident-set high-water mark (``VmHWM``) is reset by writing ``5`` to
``/proc/self/clear_refs`` once the inputs are built; the peak extra memory is ``VmHWM`` after the
first call minus ``VmRSS`` before it. That is ``ru_maxrss``'s measure (the same kernel counter)
without the inputs' own high-water mark in it. The first call is the one measured, so one-time work
(the HPU variants' prepared weight forms) counts. Memory freed while building the inputs is
returned to the kernel first (``malloc_trim``), and each workload runs in a fresh process
(``isolated.py``), so that no freed memory is reused without showing in the RSS.

Time: the median of warm calls, after that first call; fewer repetitions for slow calls, so that
the whole run fits its budget (the count is recorded).
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time

import torch

from .workload import Workload, build


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _release_free_memory() -> None:
    """Give memory freed while the inputs were built back to the kernel (glibc ``malloc_trim``).

    Otherwise the op could reuse those resident pages and its allocations would not show in the RSS.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim, the measure only gets less strict
        pass


def repetitions(first_call_s: float) -> int:
    return 5 if first_call_s < 1 else 3 if first_call_s < 5 else 1


def measure(workload: Workload, threads: int, builder=build) -> dict:
    """``builder(workload)`` makes the tensors and the zero-argument call (``workload.build`` by default;
    the MoE benchmark passes ``moe_workload.build``)."""
    torch.set_num_threads(threads)
    run = builder(workload)
    gc.collect()
    _release_free_memory()
    _reset_peak()
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    peak_extra = (_status_kib("VmHWM") - baseline) * 1024
    times = []
    for _ in range(repetitions(first)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "reps": len(times), "peak_extra_bytes": max(peak_extra, 0)}
