"""What the referee's process and the processes that run target code say to each other: one dialect for
the op worker (``conformance.isolation.child``) and the tensor-parallel ranks (``conformance.tp.rank``),
both supervised by :class:`conformance.isolation.worker.WorkerProcess`.

Every message is a frame of the wire (``conformance.wire``: JSON and raw tensor bytes, data only),
one pipe each way, a tag and a body:

=================  ==========  ==========================================================================
tag                from        body
=================  ==========  ==========================================================================
``config``         referee     the worker's configuration: ``target``, ``torch_threads``, ``stack_file``,
                               ``parent_pid``, and what a rank needs besides (``rank``, ``world_size``, …)
``facts``          worker      first, before it makes the target (op worker only): what
                               ``conformance.targets.facts.read_facts_here`` answers, so that a serial
                               run reads the facts from the worker it runs its cases in
``ready``          worker      it loaded the target: ``{"device": {name: text}}`` (a rank adds ``backend``)
``call``           referee     one case's target half: :class:`Call` (``seq``, ``level``, ``half``, ``case_id``,
                               ``request``)
``ok``             worker      its answer: :class:`Reply` (``seq``, ``case_id``, ``reply``: the level's data)
``not_supported``  rank        the rank's wrapper raised ``NotImplementedError``: :class:`Reply` with ``message``
``raise``          worker      the harness raised in the worker, or the target while it loaded:
                               :class:`Reply` with ``error`` (:class:`RemoteError`, text only)
``collective``     rank        it entered (``"in": true``) or left a collective, for the hang diagnosis
``exit``           referee     end the process
=================  ==========  ==========================================================================

A reply echoes its call's ``seq`` and ``case_id``: a reply to another call is refused like any
malformed message. The traceback in an error is formatted in the process that caught the exception
(``conformance.text.format_traceback``): its frames do not cross a pipe, their text does.

The stack file: its first line names the worker's main thread (``MAIN_THREAD_LINE`` + its id as
faulthandler prints it); every stack dump (a fatal signal, or ``STACK_DUMP_SIGNAL`` from the parent) is
appended after it.

The tags are ``str`` enums: a tag equals its word (``Tag.OK == "ok"``).
"""

from __future__ import annotations

import builtins
import enum
import signal
from dataclasses import dataclass
from typing import Any

STACK_DUMP_SIGNAL = signal.SIGUSR1
MAIN_THREAD_LINE = "main thread "


class Tag(str, enum.Enum):
    """The tag of every message on the pipes (see the module docstring)."""

    CONFIG = "config"
    FACTS = "facts"
    READY = "ready"
    CALL = "call"
    OK = "ok"
    NOT_SUPPORTED = "not_supported"
    RAISE = "raise"
    COLLECTIVE = "collective"
    EXIT = "exit"


@dataclass(frozen=True)
class RemoteError:
    """An exception raised in a worker, as text: its type's name, ``"TypeName: message (at file:line)"``, its
    whole traceback, and its type with the innermost frame of the target's code (``conformance.text.raised_at``). The referee re-raises a harness error as the builtin exception of that name, where there is
    one (``ValueError`` from a fixture stays a ``ValueError``), else as ``RuntimeError``: never a class the
    worker names beyond the builtins."""

    type: str
    text: str
    traceback: str | None = None
    raised: dict[str, str] | None = None

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        from conformance.text import describe_exception, format_traceback, raised_at, safe_text

        return cls(safe_text(getattr(type(exc), "__name__", "Exception"), 200), describe_exception(exc), format_traceback(exc),
                   raised_at(exc))

    def exception(self, where: str) -> Exception:
        """The exception the referee raises for it, its text and the worker's traceback in the message."""
        builtin = getattr(builtins, self.type, None) if self.type.isidentifier() else None
        kind = builtin if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin.__module__ == "builtins" else RuntimeError
        try:
            error = kind(f"{self.text}\n(raised in {where}:\n{self.traceback or 'no traceback'})")
        except Exception:  # noqa: BLE001 - a builtin whose constructor wants other arguments (UnicodeDecodeError)
            error = RuntimeError(f"{self.text}\n(raised in {where}:\n{self.traceback or 'no traceback'})")
        return error


@dataclass(frozen=True)
class Call:
    """A request for one case's target half: ``half`` is its ``module:function`` (the level's ``target_half``)."""

    seq: int
    level: str
    half: str
    case_id: str
    request: Any


@dataclass(frozen=True)
class WarningSeen:
    """One Python warning a call raised (its category's name, its message, where: ``file:line``) and how often it
    was shown (``conformance.isolation.output`` collects them)."""

    category: str
    message: str
    where: str
    count: int = 1


@dataclass(frozen=True)
class Reply:
    """A worker's answer to :class:`Call` ``seq``: the level's ``reply`` (``ok``), a rank's ``message``
    (``not_supported``) or an ``error`` (``raise``); with ``warnings``, the Python warnings the call raised
    (``conformance.isolation.output``: for the report, not the terminal), the most frequent ones, and in
    ``warnings_omitted`` how many distinct others it raised (a reply stays small whatever the target warns)."""

    seq: int
    case_id: str
    reply: Any = None
    message: str = ""
    error: RemoteError | None = None
    warnings: tuple[WarningSeen, ...] = ()
    warnings_omitted: int = 0
