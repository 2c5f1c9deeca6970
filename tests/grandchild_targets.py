"""Targets that start a process of their own and never wait for it (a device daemon, a compile server,
a profiler), for tests/isolation/test_process_groups.py and tests/tp. Each wraps the correct
``hpu-emulated`` target; in every ``add_lora_linear`` call (or once, when it is loaded) it starts ``sleep 600`` and, with
``$GRANDCHILD_PID_FILE`` set, appends the new process's pid to that file, so a test can check that the
process is gone after the run.
"""

from __future__ import annotations

import os
import subprocess

from misbehaving_targets import BlocksForever, _MisbehavesInAddLoraLinear

from conformance.targets.hpu.targets import HpuEmulatedTarget

PID_FILE_ENV = "GRANDCHILD_PID_FILE"
_started: list[subprocess.Popen] = []  # kept, so that no "still running" warning is printed for them


def start_a_grandchild() -> int:
    process = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _started.append(process)
    path = os.environ.get(PID_FILE_ENV)
    if path:
        with open(path, "a") as stream:
            stream.write(f"{process.pid}\n")
    return process.pid


class StartsAGrandchild(_MisbehavesInAddLoraLinear):
    """Starts ``sleep 600`` in every ``add_lora_linear`` call, without waiting for it; computes correctly."""

    name = "starts-a-grandchild"

    def misbehave(self) -> None:
        start_a_grandchild()


class StartsAGrandchildThenHangs(BlocksForever):
    """Starts ``sleep 600``, then blocks forever in native code: the case times out and its worker is killed."""

    name = "starts-a-grandchild-then-hangs"

    def misbehave(self) -> None:
        start_a_grandchild()
        super().misbehave()


class StartsAGrandchildWhenLoaded(HpuEmulatedTarget):
    """Starts ``sleep 600`` when it is constructed (a runtime that launches a daemon as it initialises)."""

    name = "starts-a-grandchild-when-loaded"

    def __init__(self) -> None:
        super().__init__()
        start_a_grandchild()
