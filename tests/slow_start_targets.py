"""A target whose module is slow to import, as one built on a framework is (JAX behind torchax took 20 s),
and that counts its imports: what a run pays for start-up is the number of imports times that time.

``$SLOW_START_SECONDS`` (default 0) is how long importing this module sleeps; with ``$SLOW_START_COUNT_FILE``
set, every import appends one line ``pid module`` to that file, so a test (or a measurement) reads how many
processes imported the target during a run::

    SLOW_START_SECONDS=20 SLOW_START_COUNT_FILE=/tmp/imports PYTHONPATH=tests \
        pytest conformance --profile=smoke --target=slow_start_targets:SlowStart

With ``$SLOW_START_ABORT`` set, the import writes :data:`LAST_WORDS` to stderr and aborts, as a framework
whose native start-up finds no device does.

``Warns`` also warns (``warnings.warn``) and prints a line to stderr in every call, as a framework that
flags a deprecated API on every kernel launch does: its run shows whether the warnings reach the report
and stay out of the terminal.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

from conformance.targets.hpu.targets import HpuEmulatedTarget

SECONDS_ENV = "SLOW_START_SECONDS"
COUNT_FILE_ENV = "SLOW_START_COUNT_FILE"
ABORT_ENV = "SLOW_START_ABORT"
LAST_WORDS = "F0000 runtime.cc:42] no device answered; aborting"

time.sleep(float(os.environ.get(SECONDS_ENV) or 0))
if os.environ.get(COUNT_FILE_ENV):
    with open(os.environ[COUNT_FILE_ENV], "a") as _count:
        _count.write(f"{os.getpid()} {' '.join(sys.argv[:3])}\n")
if os.environ.get(ABORT_ENV):  # a framework whose native start-up fails: it says why on stderr, then aborts
    print(LAST_WORDS, file=sys.stderr, flush=True)
    os.abort()


def imports_counted(path) -> list[str]:
    """The lines of a count file: one per import of this module (``[]`` when it was never imported)."""
    try:
        with open(path) as lines:
            return lines.read().splitlines()
    except FileNotFoundError:
        return []


class SlowStart(HpuEmulatedTarget):
    """The correct hpu-emulated target, behind a slow import."""

    name = "slow-start"


class FrameworkWarning(FutureWarning):
    """The warning ``Warns`` raises: a class of its own, so the report names it as the target's (a FutureWarning,
    which Python's default filters show, as the port's framework's were shown)."""


class Warns(SlowStart):
    """Warns and prints to stderr in every ``bgmv_shrink`` and ``add_lora_linear`` call (and the correct result)."""

    name = "warns"

    @staticmethod
    def chatter() -> None:
        warnings.warn("jax.experimental.shard_map is deprecated; use jax.shard_map", FrameworkWarning, stacklevel=2)
        print("W external/xla/xla/service/gpu/autotuner.cc:120] no autotuning cache, compiling", file=sys.stderr)

    def bgmv_shrink(self, *args, **kwargs):
        self.chatter()
        return super().bgmv_shrink(*args, **kwargs)

    def add_lora_linear(self, *args, **kwargs):
        self.chatter()
        return super().add_lora_linear(*args, **kwargs)


class WrongShrink(SlowStart):
    """Adds 1 to every ``bgmv_shrink`` output row: its cases fail (and are attempted again, and shrunk with
    ``--shrink``), all in the worker that is already running."""

    name = "wrong-shrink"

    def bgmv_shrink(self, *args, **kwargs):
        super().bgmv_shrink(*args, **kwargs)
        output = kwargs["output_tensor"] if "output_tensor" in kwargs else args[2]
        output += 1.0


class RefusesRanks(SlowStart):
    """Raises ``NotImplementedError`` in every wrapper call made in a tensor-parallel rank (a process group is
    up), as a port whose sharded path is not written yet does; its op cases pass."""

    name = "refuses-ranks"

    def update_metadata(self, *args, **kwargs):
        import torch.distributed

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise NotImplementedError("the sharded path is not ported yet")
        return super().update_metadata(*args, **kwargs)
