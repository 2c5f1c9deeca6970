"""The worker process: ``python -m conformance.isolation.child READ_FD WRITE_FD``.

It loads the target once, then answers calls from its parent (``conformance.isolation.process``) one
at a time, as ``conformance.isolation.protocol`` says. It never decides an outcome itself; when it
dies or hangs, the parent does. Before anything else it arranges that

* it dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so a killed run leaves no process holding a
  device;
* a fatal signal (SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL) dumps every thread's Python stack into the
  stack file the parent named, and so does SIGUSR1, which the parent sends before it stops a case that
  ran past its time: the report can then say where the target was.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from conformance.isolation.protocol import MAIN_THREAD_LINE, STACK_DUMP_SIGNAL


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent ended before the line above took effect
        os._exit(1)


def _dump_stacks_into(path: str):
    stream = open(path, "w", buffering=1)
    stream.write(f"{MAIN_THREAD_LINE}0x{threading.get_ident():016x}\n")
    faulthandler.enable(file=stream, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    return stream


def _portable(exc: BaseException) -> BaseException:
    """``exc`` with the worker's traceback as a note, or a RuntimeError saying the same if it cannot be pickled."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    try:
        exc.add_note(f"(raised in the isolated worker process {os.getpid()}:\n{text})")
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - an exception type that does not pickle
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{text}")


def main(argv: list[str]) -> int:
    commands = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)

    def reply(message) -> None:
        replies.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    config = pickle.loads(commands.recv_bytes())
    _die_with_parent(config["parent_pid"])
    stacks = _dump_stacks_into(config["stack_file"])  # noqa: F841 - kept open until the process ends
    import torch

    torch.set_num_threads(config["torch_threads"])
    from conformance.isolation.local import LocalExecutor

    try:
        executor = LocalExecutor(config["target"])
        reply(("ready", executor.device_description()))
    except Exception as exc:  # noqa: BLE001 - the parent reports it for every case
        reply(("raise", _portable(exc)))
        return 1
    while True:
        try:
            method, args = pickle.loads(commands.recv_bytes())
        except EOFError:  # the parent closed the pipe: the run is over
            return 0
        if method == "exit":
            return 0
        try:
            value = getattr(executor, method)(*args)
        except Exception as exc:  # noqa: BLE001 - the harness's own errors travel back to the parent
            reply(("raise", _portable(exc)))
        else:
            reply(("ok", value))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
