"""What the pytest process and its worker processes agree on: the op worker
(``conformance.isolation.child``) and the tensor-parallel ranks (``conformance.tp.rank``), both
supervised by :class:`conformance.isolation.worker.WorkerProcess`.

* Two pipes, one each way. The parent first sends the configuration (a pickled dict: ``target``,
  ``torch_threads``, ``stack_file``, ``parent_pid``, and what the child needs besides); the worker
  loads the target and answers ``(Tag.READY, device description)`` or ``(Tag.RAISE, exception)``.
  Then each request is a pickled ``(method, args)`` of :class:`conformance.isolation.local.LocalExecutor`
  (a rank: ``(Tag.CASE, case)``), ``(Tag.EXIT, None)`` ends the worker, and each reply is
  ``(Tag.OK, value)``, ``(Tag.RAISE, (exception, traceback text))`` (a rank: ``(Tag.RAISE, (text,
  traceback text))``) or, from a rank, ``(Tag.NOT_SUPPORTED, text)``, one at a time. The traceback is
  formatted in the process that caught the exception (``conformance.text.format_traceback``): its frames
  do not cross a pipe, their text does.
* The stack file: its first line names the worker's main thread (``MAIN_THREAD_LINE`` + its id as
  faulthandler prints it); every stack dump (a fatal signal, or ``STACK_DUMP_SIGNAL`` from the parent)
  is appended after it.

The tags are ``str`` enums: a tag equals its word (``Tag.OK == "ok"``).
"""

import enum
import io
import pickle
import signal
import sys

STACK_DUMP_SIGNAL = signal.SIGUSR1
MAIN_THREAD_LINE = "main thread "


class Tag(str, enum.Enum):
    """The first element of every message on the pipes."""

    READY = "ready"  # the target loaded; the value is the device description
    OK = "ok"  # the call returned; the value is what it returned
    RAISE = "raise"  # the call (or loading the target) raised; the value is (the exception or its text, its traceback)
    NOT_SUPPORTED = "not_supported"  # a rank's call raised NotImplementedError; the value is its text
    CASE = "case"  # a request to a rank: run this tensor-parallel case
    EXIT = "exit"  # a request: end the process


# torch's own pickling of a float8 tensor does not load back (torch 2.13 on the CPU: "UntypedStorage has no
# attribute dtype"), and the fp8 ops hand such tensors to the worker and back. Every message is pickled by
# ``dumps``, which sends a float8 tensor as its bytes (a uint8 view) and its dtype's name instead.
_BYTE_VIEWED = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _from_bytes(raw, dtype_name: str):
    """The float8 tensor whose bytes ``raw`` holds (the inverse of the uint8 view ``dumps`` sends)."""
    import torch

    return raw.view(getattr(torch, dtype_name))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # a message holds a tensor only where torch is loaded
        if torch is not None and isinstance(obj, torch.Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name in _BYTE_VIEWED:
                return _from_bytes, (obj.view(torch.uint8), name)
        return NotImplemented


def dumps(message) -> bytes:
    """``message`` pickled for a pipe (``pickle.loads`` reads it back), float8 tensors included."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()
