"""What the pytest process and its worker processes agree on: the op worker
(``conformance.isolation.child``) and the tensor-parallel ranks (``conformance.tp.rank``), both
supervised by :class:`conformance.isolation.worker.WorkerProcess`.

* Two pipes, one each way. The parent first sends the configuration (a pickled dict: ``target``,
  ``torch_threads``, ``stack_file``, ``parent_pid``, and what the child needs besides); the worker
  loads the target and answers ``(Tag.READY, device description)`` or ``(Tag.RAISE, exception)``.
  Then each request is a pickled ``(method, args)`` of :class:`conformance.isolation.local.LocalExecutor`
  (a rank: ``(Tag.CASE, case)``), ``(Tag.EXIT, None)`` ends the worker, and each reply is
  ``(Tag.OK, value)``, ``(Tag.RAISE, exception)`` (a rank: its text) or, from a rank,
  ``(Tag.NOT_SUPPORTED, text)``, one at a time.
* The stack file: its first line names the worker's main thread (``MAIN_THREAD_LINE`` + its id as
  faulthandler prints it); every stack dump (a fatal signal, or ``STACK_DUMP_SIGNAL`` from the parent)
  is appended after it.

The tags are ``str`` enums: a tag equals its word (``Tag.OK == "ok"``).
"""

import enum
import signal

STACK_DUMP_SIGNAL = signal.SIGUSR1
MAIN_THREAD_LINE = "main thread "


class Tag(str, enum.Enum):
    """The first element of every message on the pipes."""

    READY = "ready"  # the target loaded; the value is the device description
    OK = "ok"  # the call returned; the value is what it returned
    RAISE = "raise"  # the call (or loading the target) raised; the value is the exception or its text
    NOT_SUPPORTED = "not_supported"  # a rank's call raised NotImplementedError; the value is its text
    CASE = "case"  # a request to a rank: run this tensor-parallel case
    EXIT = "exit"  # a request: end the process
