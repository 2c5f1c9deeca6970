"""Running cases in a worker process, so that a target that crashes or hangs cannot take the run with it.

Each pytest process that runs cases (a serial run, or each xdist worker) keeps one worker process
(``conformance.isolation.child``) that loads the target and runs every case it is sent. The pytest
process only sends cases, waits, and records. When the worker

* **dies** while running a case (a signal such as SIGSEGV or SIGABRT, ``os._exit``, the OOM killer),
  the case ends *broken*, kind ``crashed``, its message naming the signal or exit status and the
  worker's last Python frames; the next case starts a fresh worker;
* **does not answer** within the case timeout, its stacks are dumped (SIGUSR1), it is killed (SIGKILL,
  which works on a process stuck in a device call), and the case ends *broken*, kind ``timed out``,
  naming where the target was; the run goes on with a fresh worker.

Why a process of our own rather than pytest-timeout and xdist's worker replacement alone:
pytest-timeout's signal method cannot interrupt a call blocked in native code, and its thread method
ends the whole pytest process, so a serial run would lose its report; xdist replaces a crashed worker
but names no signal, and a serial run has no worker to replace. xdist's replacement still backs this
up: should a pytest worker itself die, the controller records its case as crashed
(``conformance.plugin``), and every expected case without a result fails the gate.

The worker is spawned (never forked: a forked device runtime is undefined), inherits the environment
(so ``--devices`` reaches it) and the parent's ``sys.path`` (so ``package.module:Class`` targets
resolve the same), runs in a session of its own (a terminal's Ctrl-C is the parent's to handle), and
dies with its parent.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from conformance.cases.case import Case
from conformance.cases.features import case_features
from conformance.runner import CaseResult, Tensors
from conformance.verdict import FailureKind, Outcome

from .protocol import MAIN_THREAD_LINE, STACK_DUMP_SIGNAL

START_TIMEOUT = 600.0  # seconds a worker may take to import torch and load the target
STACK_DUMP_WAIT = 2.0  # seconds given to a hung worker to write its stacks before it is killed
SHOWN_FRAMES = 4


class TargetLoadError(RuntimeError):
    """The worker process could not load the target (its constructor raised, or loading crashed or hung);
    every case from then on reports it, with the kind of the first failure."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.RAISED) -> None:
        super().__init__(message)
        self.kind = kind


class Breakdown(Exception):
    """The worker process died or did not answer in time; ``kind`` says which."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def describe_exit(returncode: int) -> str:
    """"died with signal 6 (SIGABRT)" / "exited with status 3"."""
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        return f"died with signal {number} ({name})"
    return f"exited with status {returncode}"


def main_thread_frames(dump: str, limit: int = SHOWN_FRAMES) -> str:
    """The innermost frames of the worker's main thread in its last stack dump, "file:line in f ← …"."""
    lines = dump.splitlines()
    main_id = next((line[len(MAIN_THREAD_LINE):] for line in lines if line.startswith(MAIN_THREAD_LINE)), None)
    blocks, current = [], None
    for line in lines:
        header = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if header:
            current = [header.group(1)]
            blocks.append(current)
        elif current is not None and (frame := re.match(r'\s+File "(.+)", line (\d+) in (.+)', line)):
            current.append(f"{Path(frame.group(1)).name}:{frame.group(2)} in {frame.group(3)}")
    chosen = [b for b in blocks if b[0] == main_id] or blocks
    if not chosen or len(chosen[-1]) == 1:
        return ""
    frames = chosen[-1][1:]
    return " ← ".join(frames[:limit]) + (" ← …" if len(frames) > limit else "")


class IsolatedExecutor:
    """Forwards each call of :class:`conformance.isolation.local.LocalExecutor` to a worker process."""

    def __init__(self, target_name: str, *, case_timeout: float | None, torch_threads: int = 1) -> None:
        self.target_name = target_name
        self.case_timeout = case_timeout or None  # 0 / None: no limit
        self.torch_threads = torch_threads
        self._process: subprocess.Popen | None = None
        self._commands: Connection | None = None
        self._replies: Connection | None = None
        self._stack_file: str | None = None
        self._ready = False
        self._load_error: BaseException | None = None
        self._device: dict | None = None
        self._in_call = False  # a request is out and its reply not yet read
        self.restarts = 0  # workers started after the first

    # -- the worker's life ---------------------------------------------------------------------

    def start(self) -> None:
        """Start a worker unless one is running; it loads the target while the caller goes on."""
        if self._process is not None:
            return
        if self._stack_file is not None:
            self.restarts += 1
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        fd, self._stack_file = tempfile.mkstemp(prefix="lora-conformance-worker-", suffix=".stacks")
        os.close(fd)
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "conformance.isolation.child", str(to_child_read), str(from_child_write)],
            pass_fds=(to_child_read, from_child_write),
            stdin=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )
        os.close(to_child_read)
        os.close(from_child_write)
        self._commands = Connection(to_child_write, readable=False)
        self._replies = Connection(from_child_read, writable=False)
        self._ready = False
        config = {
            "target": self.target_name,
            "torch_threads": self.torch_threads,
            "stack_file": self._stack_file,
            "parent_pid": os.getpid(),
        }
        self._commands.send_bytes(pickle.dumps(config))

    def _stop(self, kill: bool = True) -> None:
        """End the worker (killed, or asked to exit) and forget it; the next call starts a new one."""
        process, self._process = self._process, None
        self._in_call = False
        if process is None:
            return
        if not kill and process.poll() is None:
            try:
                self._commands.send_bytes(pickle.dumps(("exit", ())))
                process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if process.poll() is None:
            process.kill()
        process.wait()
        for connection in (self._commands, self._replies):
            connection.close()
        self._commands = self._replies = None
        if self._stack_file:
            Path(self._stack_file).unlink(missing_ok=True)

    def close(self) -> None:
        """Ask the worker to exit; kill it if it is still busy with a call (the run was interrupted)."""
        self._stop(kill=self._in_call)

    def device_description(self) -> dict | None:
        """The worker's device (name and driver), as it reported when it loaded the target; None if none did."""
        return self._device

    # -- one call --------------------------------------------------------------------------------

    def _stacks(self) -> str:
        try:
            return main_thread_frames(Path(self._stack_file).read_text(errors="replace"))
        except OSError:
            return ""

    def _receive(self, timeout: float | None, doing: str, limit: str = "--case-timeout"):
        if not self._replies.poll(timeout):
            try:
                os.kill(self._process.pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:  # it ended just now; its stacks, if any, are in the file already
                pass
            deadline = time.monotonic() + STACK_DUMP_WAIT
            while time.monotonic() < deadline and "File" not in Path(self._stack_file).read_text(errors="replace"):
                time.sleep(0.05)
            where = self._stacks()
            self._stop()
            raise Breakdown(
                FailureKind.TIMED_OUT,
                f"did not finish within {timeout:g} s while {doing} ({limit}); the worker process was "
                f"killed and the run went on with a new one" + (f"; it was at {where}" if where else ""),
            )
        try:
            data = self._replies.recv_bytes()
        except (EOFError, OSError):
            try:
                returncode = self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # it closed its end of the pipe but lives on: end it
                self._process.kill()
                returncode = self._process.wait()
            where = self._stacks()
            self._stop()
            raise Breakdown(
                FailureKind.CRASHED,
                f"the worker process {describe_exit(returncode)} while {doing}; the run went on with a new one"
                + (f"; its last Python frames: {where}" if where else "; it left no Python stack (killed, or exited from native code)"),
            ) from None
        return pickle.loads(data)

    def _call(self, method: str, args: tuple, timeout: float | None, doing: str):
        if self._load_error is not None:
            raise self._load_error
        for attempt in (1, 2):
            self.start()
            if not self._ready:
                try:
                    kind, value = self._receive(
                        max(START_TIMEOUT, timeout or 0), f"loading the target for {doing}", "the worker's start-up limit"
                    )
                except Breakdown as exc:
                    # A target that crashes or hangs while it loads would do so for every case: say so once
                    # per case from now on instead of starting (and waiting for) a new worker each time.
                    self._load_error = TargetLoadError(f"the target could not be loaded in a worker process ({exc.message})", exc.kind)
                    raise
                if kind == "raise":
                    self._stop()
                    self._load_error = TargetLoadError(
                        f"the target could not be loaded in the worker process: {type(value).__name__}: {value}"
                    )
                    raise self._load_error
                self._ready, self._device = True, value
            try:
                self._commands.send_bytes(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
                break
            except OSError:  # the worker died between cases: nothing of this case ran yet, so start again
                self._stop()
                if attempt == 2:
                    raise
        self._in_call = True  # stays set if an interrupt ends the wait: close() then kills the busy worker
        kind, value = self._receive(timeout, doing)
        self._in_call = False
        if kind == "raise":
            raise value
        return value

    # -- the executor's methods ------------------------------------------------------------------

    def _run(self, method: str, case_id: str, case, args: tuple):
        started = time.perf_counter()
        try:
            return self._call(method, args, self.case_timeout, "running this case")
        except Breakdown as exc:
            return broken_result(case_id, case, exc.kind, exc.message, time.perf_counter() - started)
        except TargetLoadError as exc:
            return broken_result(case_id, case, exc.kind, str(exc))

    def run_op(self, case_id: str, case: Case, values: Tensors | None) -> CaseResult:
        return self._run("run_op", case_id, case, (case_id, case, values))

    def run_e2e(self, case):
        return self._run("run_e2e", case.case_id, case, (case,))

    def shrink(self, failing: CaseResult, limits) -> Case | None:
        """Raises :class:`Breakdown` when a candidate crashes the worker or the search outlasts 20 case timeouts."""
        timeout = 20 * self.case_timeout if self.case_timeout else None
        return self._call("shrink", (failing, limits), timeout, f"shrinking {failing.case_id}")


def broken_result(case_id: str, case, kind: FailureKind, message: str, seconds: float = 0.0) -> CaseResult:
    """The result of a case that did not return: outcome *broken*, with its kind."""
    if isinstance(case, Case):
        return CaseResult(case_id, case, Outcome.BROKEN, message, features=case_features(case), seconds=seconds, kinds=(kind,))
    from conformance.tp.case import TPCase

    if isinstance(case, TPCase):  # a tensor-parallel case whose pytest worker died (conformance.tp)
        from conformance.tp.run import TPResult

        return TPResult(case_id, case, Outcome.BROKEN, message, features=case.features(), seconds=seconds, kinds=(kind,))
    from conformance.e2e.run import E2EResult

    return E2EResult(case_id, case, Outcome.BROKEN, message, features=case.features(), seconds=seconds, kinds=(kind,))
