"""What the pytest process and its worker process (``conformance.isolation.child``) agree on.

* Two pipes, one each way. The parent first sends the configuration (a pickled dict: ``target``,
  ``torch_threads``, ``stack_file``, ``parent_pid``); the worker loads the target and answers
  ``("ready", device description)`` or ``("raise", exception)``. Then each request is a pickled
  ``(method, args)`` of :class:`conformance.isolation.local.LocalExecutor` (``("exit", ())`` ends the
  worker) and each reply ``("ok", value)`` or ``("raise", exception)``, one at a time.
* The stack file: its first line names the worker's main thread (``MAIN_THREAD_LINE`` + its id as
  faulthandler prints it); every stack dump (a fatal signal, or ``STACK_DUMP_SIGNAL`` from the parent)
  is appended after it.
"""

import signal

STACK_DUMP_SIGNAL = signal.SIGUSR1
MAIN_THREAD_LINE = "main thread "
