"""The worker process: ``python -m conformance.isolation.child READ_FD WRITE_FD``.

It loads the target once, then answers calls from its parent (``conformance.isolation.process``) one
at a time, as ``conformance.isolation.protocol`` says. It never decides an outcome itself; when it
dies or hangs, the parent does. Before anything else it arranges (``conformance.isolation.worker.prepare_child``,
as every tensor-parallel rank does) that

* it dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so a killed run leaves no process holding a
  device;
* a fatal signal (SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL) dumps every thread's Python stack into the
  stack file the parent named, and so does SIGUSR1, which the parent sends before it stops a case that
  ran past its time: the report can then say where the target was.
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing.connection import Connection

from conformance.isolation.protocol import Tag, dumps
from conformance.isolation.worker import prepare_child
from conformance.text import describe_exception, format_traceback, safe_text


def _portable(exc: BaseException, traceback: str | None = None) -> BaseException:
    """``exc`` with the worker's traceback (``traceback``, else formatted here) as a note; or, when it
    cannot be pickled or its message is not safe text (``str()`` raises, or it holds surrogates or
    control characters, or is longer than ``conformance.text.MESSAGE_LIMIT``), a RuntimeError saying the
    same in safe text. Never raises."""
    note = f"(raised in the isolated worker process {os.getpid()}:\n{traceback or format_traceback(exc)})"
    try:
        message = str(exc)
        if type(message) is str and safe_text(message) == message:
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # Python 3.10 has no add_note; 3.11 keeps its notes in the same attribute
                exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
            pickle.dumps(exc)
            return exc
    except Exception:  # noqa: BLE001 - an exception type that does not pickle, or whose str() raises
        pass
    return RuntimeError(f"{describe_exception(exc)}\n{note}")


def _raised(exc: BaseException) -> tuple:
    """The reply for an exception: the exception itself (:func:`_portable`, re-raised by the parent) and its
    traceback as text (``conformance.text.format_traceback``), which a record keeps where it is the
    target's (its constructor raised: ``conformance.isolation.process.TargetLoadError``)."""
    traceback = format_traceback(exc)  # before _portable adds its note to exc
    return Tag.RAISE, (_portable(exc, traceback), traceback)


def main(argv: list[str]) -> int:
    commands = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)

    def reply(message) -> None:
        replies.send_bytes(dumps(message))

    config = pickle.loads(commands.recv_bytes())
    prepare_child(config)
    import torch

    torch.set_num_threads(config["torch_threads"])
    from conformance.isolation.local import LocalExecutor

    try:
        executor = LocalExecutor(config["target"])
        reply((Tag.READY, executor.device_description()))
    except Exception as exc:  # noqa: BLE001 - the parent reports it for every case
        reply(_raised(exc))
        return 1
    while True:
        try:
            method, args = pickle.loads(commands.recv_bytes())
        except EOFError:  # the parent closed the pipe: the run is over
            return 0
        if method == Tag.EXIT:
            return 0
        try:
            value = getattr(executor, method)(*args)
        except Exception as exc:  # noqa: BLE001 - the harness's own errors travel back to the parent
            reply(_raised(exc))
        else:
            reply((Tag.OK, value))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
