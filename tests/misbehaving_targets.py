"""Targets that misbehave the way a backend on new hardware does: not with a wrong number, but by
crashing, hanging or breaking the calling convention. Each wraps the correct ``hpu-emulated`` target and
misbehaves in every ``add_lora_linear`` call only, so a run over a few ``add_lora_linear`` cases and a
few cases of other ops shows both that the misbehaving cases are recorded with the right kind and that
every other case is still judged. With ``$MISBEHAVE_ONCE_FILE`` set to a path that does not exist yet,
a target misbehaves in one call of the whole run only (the one that creates the file), as in::

    MISBEHAVE_ONCE_FILE=/tmp/once PYTHONPATH=tests pytest conformance --profile=smoke \
        --target=misbehaving_targets:BlocksForever --case-timeout=30 -n 2
"""

from __future__ import annotations

import os
import signal
import threading

from conformance.targets.hpu.targets import HpuEmulatedTarget

ONCE_FILE_ENV = "MISBEHAVE_ONCE_FILE"
STARTED_FILE_ENV = "MISBEHAVE_STARTED_FILE"  # created as a call starts to misbehave: the event a test waits for


class _MisbehavesInAddLoraLinear(HpuEmulatedTarget):
    def misbehave(self) -> None:
        raise NotImplementedError

    def add_lora_linear(self, y, *args, **kwargs):
        if self.now():
            if os.environ.get(STARTED_FILE_ENV):
                open(os.environ[STARTED_FILE_ENV], "a").close()
            self.misbehave()
        return super().add_lora_linear(y, *args, **kwargs)

    @staticmethod
    def now() -> bool:
        """Every call; or, with $MISBEHAVE_ONCE_FILE set, only the first call of the whole run (of all its
        processes): the one that creates that file."""
        path = os.environ.get(ONCE_FILE_ENV)
        if not path:
            return True
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True


class Aborts(_MisbehavesInAddLoraLinear):
    """A native assertion: ``abort()`` (SIGABRT), as a failed check in a C++ kernel or runtime does."""

    name = "aborts"

    def misbehave(self) -> None:
        os.abort()


class ExitsTheProcess(_MisbehavesInAddLoraLinear):
    """``exit()`` from native code: no exception, no signal, the process is just gone."""

    name = "exits"

    def misbehave(self) -> None:
        os._exit(3)


class KillsItself(_MisbehavesInAddLoraLinear):
    """SIGKILL of its own process, as the kernel's OOM killer does to a process that over-allocates."""

    name = "kills-itself"

    def misbehave(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class LoopsForever(_MisbehavesInAddLoraLinear):
    """A busy loop that never ends (a kernel polling a flag the device never sets)."""

    name = "loops-forever"

    def misbehave(self) -> None:
        while True:
            pass


class BlocksForever(_MisbehavesInAddLoraLinear):
    """A call blocked in native code that no Python signal handler interrupts (a device sync that never returns)."""

    name = "blocks-forever"

    def misbehave(self) -> None:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # the same lock again: waits in the C library forever


class RaisesDeviceError(_MisbehavesInAddLoraLinear):
    """An exception from the device runtime."""

    name = "raises"

    def misbehave(self) -> None:
        raise RuntimeError("synapse error 26: simulated device failure in add_lora_linear")


class RaisesSurrogates(_MisbehavesInAddLoraLinear):
    """An exception whose message holds what a driver's bytes become when decoded with ``surrogateescape``
    (a lone surrogate), a NUL and a terminal escape: text no UTF-8 writer accepts as it is."""

    name = "raises-surrogates"
    MESSAGE = "driver said \udcff\udcfe at \x00 then \x1b[31mred\x1b[0m: simulated device failure"

    def misbehave(self) -> None:
        raise RuntimeError(self.MESSAGE)


class UnprintableError(RuntimeError):
    """An exception type whose ``__str__`` and ``__repr__`` raise (a binding's exception wrapping a dead handle)."""

    def __str__(self) -> str:
        raise ValueError("the device handle is gone")

    def __repr__(self) -> str:
        raise ValueError("the device handle is gone")


class RaisesUnprintable(_MisbehavesInAddLoraLinear):
    """An exception that cannot be turned into text: its ``__str__`` and ``__repr__`` raise."""

    name = "raises-unprintable"

    def misbehave(self) -> None:
        raise UnprintableError("simulated device failure")


class RaisesHugeMessage(_MisbehavesInAddLoraLinear):
    """An exception with a 10 MB message (a runtime that puts a whole device log into its error)."""

    name = "raises-huge-message"
    SIZE = 10_000_000

    def misbehave(self) -> None:
        line = "synapse log: simulated device failure in add_lora_linear, queue 0 state dump 0123456789abcdef\n"
        raise RuntimeError((line * (self.SIZE // len(line) + 1))[: self.SIZE])


class ReturnsANewTensor(HpuEmulatedTarget):
    """Computes the right result into a new tensor and returns it, leaving ``y`` untouched: the wrapper
    methods' contract is to write into ``y``, which this silently breaks."""

    name = "returns-new-tensor"

    def add_lora_linear(self, y, *args, **kwargs):
        result = y.clone()
        super().add_lora_linear(result, *args, **kwargs)
        return result


MISBEHAVING = {
    cls.name: cls
    for cls in (
        Aborts, ExitsTheProcess, KillsItself, LoopsForever, BlocksForever, RaisesDeviceError, RaisesSurrogates,
        RaisesUnprintable, RaisesHugeMessage, ReturnsANewTensor,
    )
}


class AbortsWhileLoading(HpuEmulatedTarget):
    """Its runtime aborts while the target is constructed (a device that fails to initialise)."""

    name = "aborts-while-loading"

    def __init__(self) -> None:
        os.abort()


class SumsInBfloat16(HpuEmulatedTarget):
    """Patches ``torch.sum`` in its own process when it loads, so that every float32 sum comes back rounded to
    bfloat16: the ``device_sum`` level (examples/custom_level) must fail it, which it can only do if that
    level's half runs where the target's code runs and its judgement where the target's code cannot reach."""

    name = "sums-in-bfloat16"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        import torch

        exact_sum = torch.sum

        def bfloat16_sum(*args, **kwargs):
            return exact_sum(*args, **kwargs).to(torch.bfloat16).to(torch.float32)

        torch.sum = bfloat16_sum
