"""One supervised worker process: how the op worker (``conformance.isolation.process``) and every
tensor-parallel rank (``conformance.tp.pool``) are started, talked to, and ended.

A worker is ``python -m MODULE READ_FD WRITE_FD``: spawned (never forked: a forked device runtime is
undefined), inheriting the environment (so ``--devices`` reaches it) and the parent's ``sys.path`` (so
``package.module:Class`` targets resolve the same), in a session of its own (a terminal's Ctrl-C is
the parent's to handle; and its pid is its process group), dying with its parent (``prepare_child``,
which the child calls first). It talks frames of data over two pipes (``conformance.isolation.protocol``,
``conformance.wire``): nothing a worker sends is ever unpickled or run.

* **A call that does not answer** within its time: the worker's Python stacks are dumped into its
  stack file (SIGUSR1, up to ``STACK_DUMP_WAIT`` seconds), then it is killed (SIGKILL, which works on
  a process stuck in a device call), and :class:`Breakdown` (kind ``timed out``) says where it was.
* **A worker that dies**: :class:`Breakdown` (kind ``crashed``) names the signal or exit status and
  its last Python frames (faulthandler writes them on a fatal signal).
* **A reply the wire refuses** (not a frame, a declared size above what the call allows, an unknown
  dtype, bytes that do not match their shape, a reply to another call): :class:`Breakdown` (kind
  ``malformed reply``) says what was wrong; the worker is killed, since its stream is out of step.
* **Ending a worker** (:meth:`WorkerProcess.stop`), after a breakdown or at close, ends its whole
  process group (``os.killpg``, SIGKILL), so a process the target started (a compiler, a device
  daemon, a ``sleep``) does not outlive the worker and hold a device or a core. Processes still in the
  group once the worker itself is gone are named first (``"pid N (command)"``, read from ``/proc`` on
  Linux, nothing elsewhere) in :attr:`WorkerProcess.leftovers`, so a record can say that the target
  left them running. A process that left the group (``setsid``) is out of reach.

This module imports only the standard library, the failure kinds, the protocol and the wire's frames, so
that any supervisor can use it without importing what runs cases.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from conformance.verdict.failure_kind import FailureKind
from conformance.wire.frame import Channel, Limits, Message, WireError

from .protocol import MAIN_THREAD_LINE, STACK_DUMP_SIGNAL, Tag

STACK_DUMP_WAIT = 2.0  # seconds given to a hung worker to write its stacks before it is killed
EXIT_WAIT = 10.0  # seconds a worker asked to exit (or that closed its pipe) has before it is killed
LEFTOVER_GRACE = 1.0  # seconds the rest of the group of a worker that exited by itself has to end by itself
KILL_WAIT = 2.0  # seconds to wait for a killed process group to be gone
DEFAULT_LIMITS = Limits()
SEND_TIMEOUT = 60.0  # seconds a worker may leave its request pipe full (it reads a request whole, between cases)
SHOWN_FRAMES = 4
COMMAND_CHARS = 120  # of a leftover process's command line
OUTPUT_READ_BYTES = 64 * 1024  # of a worker's output read at a time (conformance.isolation.output); the rest is counted


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


# -- process groups --------------------------------------------------------------------------------


def process_group_members(pgid: int, exclude: tuple[int, ...] = ()) -> list[str]:
    """The live processes of process group ``pgid`` (not zombies), as "pid N (command)", read from ``/proc``;
    ``[]`` where there is no ``/proc`` (not Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes().decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        head, _, tail = stat.rpartition(")")  # "pid (comm) state ppid pgrp …"; comm may hold ")" or spaces
        fields = tail.split()
        if len(fields) < 3 or fields[0] in ("Z", "X") or int(fields[2]) != pgid:
            continue
        try:
            command = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = ""
        command = command or head.partition("(")[2]
        if len(command) > COMMAND_CHARS:
            command = command[: COMMAND_CHARS - 1] + "…"
        found.append(f"pid {name} ({command})")
    return found


def kill_process_group(pgid: int) -> None:
    """SIGKILL to every process of group ``pgid``; nothing if none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def describe_leftovers(leftovers: list[str]) -> str:
    """What a record says about processes a target left running ("" when there were none)."""
    if not leftovers:
        return ""
    return f"the target left {len(leftovers)} process(es) running: {', '.join(leftovers)}; they were killed"


# -- the parent's side -----------------------------------------------------------------------------


class WorkerProcess:
    """One worker process, spawned once (:meth:`spawn`) and ended once (:meth:`stop`)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._channel: Channel | None = None
        self._stack_file: str | None = None
        self._output_file: str | None = None  # its stdout and stderr, with capture_output
        self._output_offset = 0  # read up to here (the file is emptied when nothing new came meanwhile)
        self._unread_output: tuple[str, int] = ("", 0)  # what stop() read of it before removing the file
        self._exit_sent = False
        self._stopped = False
        self.leftovers: list[str] = []  # processes of its group found running when it was stopped, "pid N (command)"

    @property
    def pid(self) -> int | None:
        """The worker's pid, which is also its process group's id; ``None`` before it was spawned."""
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and not self._stopped and self._process.poll() is None

    @property
    def connection(self) -> Channel:
        """The end the worker's replies arrive at (for ``multiprocessing.connection.wait`` over several workers)."""
        return self._channel

    def spawn(self, module: str, config: dict, *, env_updates: dict[str, str] | None = None, capture_output: bool = False) -> None:
        """Start ``python -m module READ_FD WRITE_FD`` and send it ``config`` with ``stack_file`` and
        ``parent_pid`` added; returns at once (the worker loads what it must while the caller goes on).
        ``capture_output``: its stdout and stderr go to a file of its own (``output_file`` in the config), read
        with :meth:`take_output`, rather than to this process's terminal."""
        if self._process is not None:
            raise RuntimeError("a WorkerProcess is spawned once; start a new one")
        fd, self._stack_file = tempfile.mkstemp(prefix="lora-conformance-worker-", suffix=".stacks")
        os.close(fd)
        if capture_output:
            fd, self._output_file = tempfile.mkstemp(prefix="lora-conformance-worker-", suffix=".output")
            os.close(fd)
            config = {**config, "output_file": self._output_file}
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
        environment.update(env_updates or {})
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", module, str(to_child_read), str(from_child_write)],
                pass_fds=(to_child_read, from_child_write),
                stdin=subprocess.DEVNULL,
                env=environment,
                start_new_session=True,  # its own session and process group: pid == pgid
            )
        except BaseException:
            for descriptor in (to_child_read, to_child_write, from_child_read, from_child_write):
                os.close(descriptor)
            Path(self._stack_file).unlink(missing_ok=True)
            if self._output_file:
                Path(self._output_file).unlink(missing_ok=True)
            raise
        finally:
            if self._process is not None:
                os.close(to_child_read)
                os.close(from_child_write)
        self._channel = Channel(from_child_read, to_child_write, referee=True)
        self.send(Tag.CONFIG, {**config, "stack_file": self._stack_file, "parent_pid": os.getpid()})

    # -- messages ----------------------------------------------------------------------------------

    def send(self, tag: Tag, body=None, timeout: float | None = SEND_TIMEOUT) -> None:
        """One frame to the worker; ``OSError`` (BrokenPipeError) when it is gone, ``TimeoutError`` when it stopped
        reading for ``timeout`` seconds (its stdin pipe full: it hangs), ``TypeError`` for what no frame carries."""
        if self._channel is None:
            raise BrokenPipeError("the worker process was stopped")
        self._channel.send(tag, body, timeout=timeout)

    def poll(self, timeout: float | None) -> bool:
        """Whether a reply (or the worker's end) arrived within ``timeout`` seconds (``None``: wait)."""
        return self._channel.poll(timeout)

    def read(self, limits: Limits = DEFAULT_LIMITS) -> Message:
        """The next message, read as data within ``limits``; ``EOFError`` or ``OSError`` when the worker closed its
        pipe (it died), :class:`~conformance.wire.WireError` for a frame the wire refuses, ``TimeoutError`` for a
        frame that stopped arriving midway."""
        if self._channel is None:
            raise EOFError("the worker process was stopped")
        return self._channel.receive(limits)

    def receive(self, timeout: float | None, doing: str, limit: str = "--case-timeout", limits: Limits = DEFAULT_LIMITS) -> Message:
        """The next message within ``timeout`` seconds; otherwise, or if the worker dies first, or sends what the wire
        refuses, it is stopped and :class:`Breakdown` says what happened ``while {doing}`` (``limit`` names the time limit)."""
        if not self.poll(timeout):
            self.dump_stacks()
            self.wait_for_stacks(STACK_DUMP_WAIT)
            where = self.frames()
            self.stop()
            raise Breakdown(
                FailureKind.TIMED_OUT,
                f"did not finish within {timeout:g} s while {doing} ({limit}); the worker process was "
                f"killed and the run went on with a new one" + (f"; it was at {where}" if where else ""),
            )
        try:
            return self.read(limits)
        except WireError as exc:
            self.stop()
            raise self.refused(str(exc), doing) from None
        except TimeoutError:
            self.stop()
            raise Breakdown(
                FailureKind.TIMED_OUT,
                f"started a reply while {doing} and did not finish sending it within {limits.transfer_seconds:g} s; "
                "the worker process was killed and the run went on with a new one",
            ) from None
        except (EOFError, OSError):
            raise self.crashed(doing) from None

    def crashed(self, doing: str) -> Breakdown:
        """The worker closed its pipe: it is stopped, and the breakdown names how it ended and where it was."""
        returncode = self.exit_status()
        where = self.frames()
        self.stop()
        return Breakdown(
            FailureKind.CRASHED,
            f"the worker process {describe_exit(returncode)} while {doing}; the run went on with a new one"
            + (f"; its last Python frames: {where}" if where else "; it left no Python stack (killed, or exited from native code)"),
        )

    @staticmethod
    def refused(what: str, doing: str, stopped: bool = True) -> Breakdown:
        """A reply the referee refuses (the wire, or the level's check of it); ``stopped``: the worker was killed for it."""
        after = "the worker process was killed and the run went on with a new one" if stopped else "the run went on"
        return Breakdown(FailureKind.MALFORMED_REPLY,
                         f"the worker's reply was refused while {doing}: {what}; nothing in it was judged, {after}")

    # -- what it was doing -------------------------------------------------------------------------

    def dump_stacks(self) -> None:
        """Ask the worker (not its group: SIGUSR1 would end a process without a handler) for its Python stacks."""
        if self.alive:
            try:
                os.kill(self._process.pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:  # it ended just now; its stacks, if any, are in the file already
                pass

    def has_stacks(self) -> bool:
        """Whether a stack dump is in the stack file."""
        try:
            return "File" in Path(self._stack_file).read_text(errors="replace")
        except (OSError, TypeError):
            return False

    def wait_for_stacks(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.has_stacks():
            time.sleep(0.05)

    def frames(self) -> str:
        """The innermost frames of its main thread in its last stack dump ("" if there is none)."""
        try:
            return main_thread_frames(Path(self._stack_file).read_text(errors="replace"))
        except (OSError, TypeError):
            return ""

    def exit_status(self, wait: float = EXIT_WAIT) -> int:
        """Its return code once it ended; one that closed its pipe but lives on after ``wait`` seconds is killed."""
        try:
            return self._process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait()

    def take_output(self, limit: int = OUTPUT_READ_BYTES) -> tuple[str, int]:
        """What the worker wrote to its stdout and stderr since the last call (with ``capture_output``): up to
        ``limit`` bytes of it as text, and how many bytes more there were. The file is then emptied (the worker
        writes in append mode: it goes on at the new end) unless something was written meanwhile, which would be
        lost: then the next call reads on from here."""
        text, omitted = self._unread_output
        self._unread_output = ("", 0)
        if not self._output_file:
            return text, omitted
        try:
            with open(self._output_file, "rb") as stream:
                stream.seek(self._output_offset)
                data = stream.read(limit)
                size = stream.seek(0, os.SEEK_END)
            omitted += max(0, size - self._output_offset - len(data))
            self._output_offset = size
            if os.path.getsize(self._output_file) == size:
                os.truncate(self._output_file, 0)
                self._output_offset = 0
        except OSError:
            return text, omitted
        return text + data.decode("utf-8", "backslashreplace"), omitted

    # -- its end -----------------------------------------------------------------------------------

    def ask_to_exit(self) -> None:
        """Send the exit request (once); a worker that is gone already is left to :meth:`stop`."""
        if self._exit_sent or not self.alive:
            return
        self._exit_sent = True
        try:
            self.send(Tag.EXIT)
        except OSError:
            pass

    def stop(self, kill: bool = True) -> list[str]:
        """End the worker, killed (``kill``) or asked to exit (killed after ``EXIT_WAIT`` s), then its whole
        process group; returns the processes of the group found still running once the worker was gone
        (also added to :attr:`leftovers`). A second call does nothing and returns ``[]``."""
        if self._process is None or self._stopped:
            return []
        process = self._process
        exited_by_itself = False
        if not kill:
            if process.poll() is None:
                self.ask_to_exit()
                try:
                    process.wait(timeout=EXIT_WAIT)
                except subprocess.TimeoutExpired:
                    pass
            exited_by_itself = process.poll() is not None
        self._stopped = True
        if process.poll() is None:
            process.kill()
        process.wait()
        found = self._end_group(process.pid, LEFTOVER_GRACE if exited_by_itself else 0.0)
        self._channel.close()
        self._channel = None
        Path(self._stack_file).unlink(missing_ok=True)
        if self._output_file:  # what it said last (a crash's last words) stays readable through take_output
            self._unread_output = self.take_output()
            Path(self._output_file).unlink(missing_ok=True)
            self._output_file = None
        self.leftovers.extend(found)
        return found

    @staticmethod
    def _end_group(pgid: int, grace: float) -> list[str]:
        """Name what is left of the group (after ``grace`` seconds to end by itself), kill it, and wait until it is gone."""
        deadline = time.monotonic() + grace
        found = process_group_members(pgid)
        while found and time.monotonic() < deadline:
            time.sleep(0.05)
            found = process_group_members(pgid)
        kill_process_group(pgid)
        deadline = time.monotonic() + KILL_WAIT
        while found and process_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return found


# -- the worker's side -----------------------------------------------------------------------------

_stack_stream = None  # the open stack file of this process (prepare_child), kept open until it ends


def prepare_child(config: dict):
    """What a worker does first, with the configuration its parent sent: die with the parent
    (``PR_SET_PDEATHSIG`` on Linux), so a killed run leaves no process holding a device; and dump every
    thread's Python stack into ``config["stack_file"]`` on a fatal signal (SIGSEGV, SIGABRT, SIGFPE,
    SIGBUS, SIGILL) and on ``STACK_DUMP_SIGNAL``, which the parent sends before it kills a worker that
    ran past its time; with ``output_file`` in the config, write stdout and stderr there. Returns the open stack file."""
    global _stack_stream
    parent_pid = config["parent_pid"]
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent ended before the line above took effect
        os._exit(1)
    if config.get("output_file"):  # stdout and stderr (native code's too) into the file the parent reads
        descriptor = os.open(config["output_file"], os.O_WRONLY | os.O_APPEND)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        os.close(descriptor)
        if hasattr(sys.stdout, "reconfigure"):  # a print reaches the file by the reply that follows it
            sys.stdout.reconfigure(line_buffering=True)
    stream = open(config["stack_file"], "w", buffering=1)  # open until the process ends
    stream.write(f"{MAIN_THREAD_LINE}0x{threading.get_ident():016x}\n")
    faulthandler.enable(file=stream, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    _stack_stream = stream
    return stream


def flush_output() -> None:
    """Flush Python's stdout and stderr, and C's ``stdio`` buffers (a worker's, before it replies: its parent reads
    the output then). Native code's ``printf`` to a file is block-buffered: without ``fflush(NULL)`` its lines
    would arrive with a later case, or only at the worker's end."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken by the target: nothing to keep
            pass
    libc = _c_library()
    if libc is not None:
        libc.fflush(None)


@functools.cache
def _c_library():
    """The C library of this process (for ``fflush``), or None where ctypes cannot name it."""
    if os.name != "posix":
        return None
    try:
        import ctypes

        return ctypes.CDLL(None)
    except (ImportError, OSError):
        return None
