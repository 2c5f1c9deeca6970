"""Running cases in a worker process, so that a target that crashes or hangs cannot take the run with it.

Each pytest process that runs cases (a serial run, or each xdist worker) keeps one worker process
(``conformance.isolation.child``) that loads the target and runs every case it is sent. The pytest
process only sends cases, waits, and records. When the worker

* **dies** while running a case (a signal such as SIGSEGV or SIGABRT, ``os._exit``, the OOM killer),
  the case ends *broken*, kind ``crashed``, its message naming the signal or exit status and the
  worker's last Python frames; the next case starts a fresh worker;
* **does not answer** within the case timeout, its stacks are dumped (SIGUSR1), it is killed (SIGKILL,
  which works on a process stuck in a device call), and the case ends *broken*, kind ``timed out``,
  naming where the target was; the run goes on with a fresh worker;
* **answers what the referee does not accept as data** (``conformance.wire``: not a frame, a tensor
  larger than the case allows, a record of the wrong type, a reply to another call), it is killed and
  the case ends *broken*, kind ``malformed reply``, naming what was wrong; nothing of it was judged.

Why a process of our own rather than pytest-timeout and xdist's worker replacement alone:
pytest-timeout's signal method cannot interrupt a call blocked in native code, and its thread method
ends the whole pytest process, so a serial run would lose its report; xdist replaces a crashed worker
but names no signal, and a serial run has no worker to replace. xdist's replacement still backs this
up: should a pytest worker itself die, the controller records its case as crashed
(``conformance.plugin``), and every expected case without a result fails the gate.

The worker is a :class:`conformance.isolation.worker.WorkerProcess` (as every tensor-parallel rank
is): spawned (never forked: a forked device runtime is undefined), inheriting the environment (so
``--devices`` reaches it) and the parent's ``sys.path`` (so ``package.module:Class`` targets resolve
the same), in a session of its own (a terminal's Ctrl-C is the parent's to handle), dying with its
parent. When it is stopped (a crash, a timeout, the end of the run) its whole process group is killed,
so nothing the target started outlives it; what was still running is kept in
``IsolatedExecutor.leftover_processes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.targets.base import TargetError, TargetUnavailable
from conformance.targets.facts import TargetFacts, facts_from_answer
from conformance.verdict import FailureKind
from conformance.wire import Limits, WireError, from_data

from .output import TargetOutput
from .protocol import Reply, Tag
from .worker import STACK_DUMP_WAIT, Breakdown, WorkerProcess, describe_exit, describe_leftovers, main_thread_frames

__all__ = [
    "START_TIMEOUT", "STACK_DUMP_WAIT", "Breakdown", "IsolatedExecutor", "TargetLoadError",
    "describe_exit", "describe_leftovers", "main_thread_frames",
]  # fmt: skip

START_TIMEOUT = 600.0  # seconds a worker may take to import torch and load the target
READY_LIMITS = Limits(header_bytes=1 << 20, tensor_bytes=0, tensors=0)  # a device description, or an error


class TargetLoadError(RuntimeError):
    """The worker process could not load the target (its constructor raised, or loading crashed or hung);
    every case from then on reports it, with the kind of the first failure (and, where it raised, its
    traceback and ``raised``: its type and the innermost frame of the target's code)."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.RAISED, traceback: str | None = None,
                 raised: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.traceback = traceback  # what the constructor raised, formatted in the worker; None for a crash or hang
        self.raised = raised


class IsolatedExecutor:
    """Runs each call of :class:`conformance.isolation.local.LocalExecutor` in a worker process
    (:class:`conformance.isolation.worker.WorkerProcess`)."""

    def __init__(self, target_name: str, *, case_timeout: float | None, torch_threads: int = 1) -> None:
        self.target_name = target_name
        self.case_timeout = case_timeout or None  # 0 / None: no limit
        self.torch_threads = torch_threads
        self._worker: WorkerProcess | None = None
        self._started = False  # a worker was started before (the next start is a restart)
        self._facts_read = False  # the running worker's first message (its facts) was read
        self._facts: TargetFacts | None = None  # as the first worker read them
        self._ready = False
        self._load_error: TargetLoadError | None = None
        self._device: dict | None = None
        self._in_call = False  # a request is out and its reply not yet read
        self._seq = 0  # calls sent: each reply must echo its call's number
        self.restarts = 0  # workers started after the first
        self.starts = 0  # workers started: each imports the target (a framework's start-up, every time)
        self._output = TargetOutput()  # what the target said since take_output (conformance.isolation.output)
        self.load_output = TargetOutput()  # what it said while its workers loaded it, for the run's record
        # processes a target started and left running in a worker's process group, found when that worker
        # was stopped (after a crash or a timeout, or at close) and killed with it: "pid N (command)"
        self.leftover_processes: list[str] = []

    # -- the worker's life ---------------------------------------------------------------------

    def start(self) -> None:
        """Start a worker unless one is running; it loads the target while the caller goes on."""
        if self._worker is not None:
            return
        if self._started:
            self.restarts += 1
        self._started = True
        self.starts += 1
        self._ready = False
        self._facts_read = False
        worker = WorkerProcess()
        worker.spawn("conformance.isolation.child", {"target": self.target_name, "torch_threads": self.torch_threads},
                     capture_output=True)
        self._worker = worker

    def _stop(self, kill: bool = True) -> None:
        """End the worker (killed, or asked to exit) and its process group, and forget it; the next call
        starts a new one. Processes the target left in the group are added to ``leftover_processes``."""
        worker, self._worker = self._worker, None
        self._in_call = False
        if worker is None:
            return
        worker.stop(kill=kill)  # nothing if it was stopped already (a breakdown)
        self.leftover_processes.extend(worker.leftovers)
        # its last words (a crash's message) belong to the case it was running, or to its start-up
        (self._output if self._ready else self.load_output).add_text(*worker.take_output())

    def close(self, kill: bool = False) -> None:
        """Ask the worker to exit; kill it if it is still busy with a call (the run was interrupted), or with ``kill``
        (a run refused before any case: a worker still importing the target would read the request only once loaded)."""
        self._stop(kill=kill or self._in_call)

    def facts(self) -> TargetFacts:
        """The target's facts, as the worker read them before it made the target (a worker is started if none
        runs): a serial run reads them from the process that will run its cases, so it imports the target once.
        Raises :class:`TargetError` or :class:`TargetUnavailable` as ``conformance.targets.facts.probe`` does,
        including for a worker that died or hung before it said them."""
        if self._facts is None:
            self.start()
            try:
                self._read_facts("reading the target's facts")
            except Breakdown as exc:  # no run goes on without facts: the breakdown's "went on with a new one" is not so
                said = exc.message.replace("; the run went on with a new one", "").replace(" and the run went on with a new one", "")
                last = list(self.load_output.lines)[-1:]  # what it wrote last (a native crash's message), as probe said it
                raise TargetError(f"target {self.target_name!r}: its worker process did not say its facts: {said}"
                                  + (f"; the last line it wrote: {last[0]}" if last else "")) from None
            except WireError as exc:
                self._stop()
                raise TargetError(f"target {self.target_name!r}: its worker process answered what is not facts: {exc}") from None
        return self._facts

    def _read_facts(self, doing: str) -> None:
        """Read the running worker's first message, its facts (``TargetError`` / ``TargetUnavailable`` for what it reports)."""
        message = self._receive(START_TIMEOUT, doing, "the worker's start-up limit")
        if message.tag != Tag.FACTS:
            raise WireError(f"the worker's first message is {message.tag[:40]!r}, not facts")
        try:
            facts = facts_from_answer(self.target_name, message.body)
        except (TargetError, TargetUnavailable):
            self._stop()
            raise
        self._facts_read = True
        self._facts = self._facts or facts

    def take_output(self) -> TargetOutput:
        """What the target said (warnings, output lines) in the calls since the last time: the case's, for its record."""
        output, self._output = self._output, TargetOutput()
        return output

    def device_description(self) -> dict | None:
        """The worker's device (name and driver), as it reported when it loaded the target; None if none did."""
        return self._device

    def leftover_description(self) -> str:
        """What a record says about ``leftover_processes``: "the target left N process(es) running: …; they were killed", or ""."""
        return describe_leftovers(self.leftover_processes)

    # -- one call --------------------------------------------------------------------------------

    def _receive(self, timeout: float | None, doing: str, limit: str = "--case-timeout", limits: Limits = READY_LIMITS):
        try:
            return self._worker.receive(timeout, doing, limit, limits)
        except Breakdown:
            self._stop()  # the worker is stopped already: this forgets it and keeps what it left running
            raise

    def _refuse(self, what: str, doing: str) -> Breakdown:
        """Stop the worker for a reply the referee refuses; the breakdown to raise."""
        self._stop()
        return WorkerProcess.refused(what, doing)

    def _await_ready(self, timeout: float | None, doing: str) -> None:
        try:
            if not self._facts_read:
                try:
                    self._read_facts(f"loading the target for {doing}")
                except (TargetError, TargetUnavailable) as exc:  # the facts came from elsewhere (an xdist controller)
                    self._load_error = TargetLoadError(f"the target could not be loaded in the worker process: {exc}")
                    raise self._load_error from None
            message = self._receive(max(START_TIMEOUT, timeout or 0), f"loading the target for {doing}", "the worker's start-up limit")
            if message.tag == Tag.RAISE:
                error = from_data(Reply, message.body).error
                if error is None:
                    raise WireError("a raise without its error")
                self._stop()
                self._load_error = TargetLoadError(
                    f"the target could not be loaded in the worker process: {error.text}", traceback=error.traceback,
                    raised=error.raised)
                raise self._load_error
            if message.tag != Tag.READY:
                raise WireError(f"the worker's first message is {message.tag[:40]!r}, not ready")
            self._device = from_data(dict[str, dict[str, str]], message.body, "ready")["device"]
            self.load_output.add_text(*self._worker.take_output())
        except WireError as exc:
            exc = self._refuse(str(exc), f"loading the target for {doing}")
            self._load_error = TargetLoadError(f"the target could not be loaded in a worker process ({exc.message})", exc.kind)
            raise self._load_error from None
        except Breakdown as exc:
            # A target that crashes or hangs while it loads would do so for every case: say so once
            # per case from now on instead of starting (and waiting for) a new worker each time.
            self._load_error = TargetLoadError(f"the target could not be loaded in a worker process ({exc.message})", exc.kind)
            raise
        self._ready = True

    def call(self, level: str, half: str, case_id: str, request: Any, *, limits: Limits,
             parse: Callable[[Any], Any] | None = None, doing: str = "running this case") -> Any:
        """``level``'s target half (``half``, ``module:function``) on ``request`` in the worker: its answer, read as data within ``limits`` and then
        by ``parse`` (the level's typed reading of it, which raises ``WireError`` for what it refuses). Raises :class:`Breakdown` when the worker dies, hangs or answers what the
        referee refuses, :class:`TargetLoadError` when it cannot load the target, and the harness's own error
        (a ``RemoteError`` re-raised) when the half raised in the worker."""
        if self._load_error is not None:
            raise self._load_error
        self._seq += 1
        seq = self._seq
        for attempt in (1, 2):
            self.start()
            if not self._ready:
                self._await_ready(self.case_timeout, doing)
            try:
                self._worker.send(Tag.CALL, {"seq": seq, "level": level, "half": half, "case_id": case_id, "request": request})
                break
            except OSError:  # the worker died between cases: nothing of this case ran yet, so start again
                self._stop()
                if attempt == 2:
                    raise
            except TimeoutError:  # it stopped reading its requests: it hangs
                self._stop()
                raise Breakdown(FailureKind.TIMED_OUT, f"the worker process stopped reading its requests while {doing}; "
                                "it was killed and the run went on with a new one") from None
        self._in_call = True  # stays set if an interrupt ends the wait: close() then kills the busy worker
        message = self._receive(self.case_timeout, doing, limits=limits)
        self._in_call = False
        try:
            if message.tag not in (Tag.OK, Tag.RAISE):
                raise WireError(f"the tag {message.tag[:40]!r} answers no call")
            reply = from_data(Reply, message.body, "the reply")
            if (reply.seq, reply.case_id) != (seq, case_id):
                raise WireError(f"it answers call {reply.seq} for case {reply.case_id[:200]!r}, not call {seq} for this case "
                                f"({case_id!r})")
        except WireError as exc:
            raise self._refuse(str(exc), doing) from None
        self._output.add_warnings(reply.warnings, reply.warnings_omitted)
        self._output.add_text(*self._worker.take_output())
        if message.tag == Tag.RAISE:  # the harness raised in the worker (not the target: that is in the answer)
            if reply.error is None:
                raise self._refuse("a raise without its error", doing)
            raise reply.error.exception(f"the isolated worker process {self._worker.pid}")
        if parse is None:
            return reply.reply
        try:
            return parse(reply.reply)
        except WireError as exc:
            raise self._refuse(str(exc), doing) from None
