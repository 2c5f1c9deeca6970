"""A pool of rank processes, one per tensor-parallel rank, kept alive across the cases of one TP size.

Starting a rank costs a Python process with torch and the target loaded (about a second on a CPU,
more with a device runtime), so a pool is started once per TP size and serves every case of that size.
When a case goes wrong the pool cannot be trusted any more (a collective may be half done on some
ranks): a rank that raises, dies or does not answer within the case timeout ends the whole pool, the
case is recorded (:class:`RankFailure`), and the next case starts a fresh pool. Ranks are started like
the op worker (``conformance.isolation.process``): spawned (never forked), the parent's environment
and ``sys.path``, a session of their own, dying with their parent; a hung rank is asked for its
Python stacks (SIGUSR1) before it is killed, so the record says where it was.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from conformance.isolation.process import describe_exit, main_thread_frames
from conformance.isolation.protocol import STACK_DUMP_SIGNAL
from conformance.verdict import FailureKind

START_TIMEOUT = 600.0  # seconds for every rank to load torch and the target and join the process group
STACK_DUMP_WAIT = 2.0
CRASH_GRACE = 0.5  # after a rank raises, how long to look whether a peer died (its death is the cause)


class RankFailure(Exception):
    """A case ended on some rank without an answer: ``kind`` raised / crashed / timed out, or ``None`` for
    a ``NotImplementedError`` (not supported). ``ranks`` are the ranks it names."""

    def __init__(self, kind: FailureKind | None, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.kind, self.message, self.ranks = kind, message, ranks


class _Rank:
    def __init__(self, rank: int, process: subprocess.Popen, commands: Connection, replies: Connection, stack_file: str) -> None:
        self.rank, self.process, self.commands, self.replies, self.stack_file = rank, process, commands, replies, stack_file

    def send(self, message) -> None:
        self.commands.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def frames(self) -> str:
        try:
            return main_thread_frames(Path(self.stack_file).read_text(errors="replace"))
        except OSError:
            return ""


class RankPool:
    """``tp_size`` rank processes of one target; ``run(case, timeout)`` returns rank 0's gathered output.

    ``devices``: the device id each rank is given through ``device_env`` (``None``: every rank uses the
    target's own device, as on the CPU).
    """

    def __init__(self, target_name: str, tp_size: int, *, torch_threads: int = 1, devices: list[str] | None = None,
                 device_env: str | None = None) -> None:
        if devices is not None and len(devices) < tp_size:
            raise ValueError(f"tensor parallelism {tp_size} needs {tp_size} devices, one per rank; --devices gives {len(devices)}")
        self.target_name, self.tp_size, self.torch_threads = target_name, tp_size, torch_threads
        self.devices, self.device_env = devices, device_env
        self._ranks: list[_Rank] = []
        self._directory: str | None = None
        self.device: dict | None = None  # rank 0's device description, once the pool started
        self.starts = 0

    @property
    def alive(self) -> bool:
        return bool(self._ranks)

    def start(self) -> None:
        """Start every rank and wait until each has loaded the target and joined the process group."""
        if self._ranks:
            return
        self.starts += 1
        self._directory = tempfile.mkdtemp(prefix=f"lora-conformance-tp{self.tp_size}-")
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
        for rank in range(self.tp_size):
            to_child_read, to_child_write = os.pipe()
            from_child_read, from_child_write = os.pipe()
            stack_file = os.path.join(self._directory, f"rank{rank}.stacks")
            Path(stack_file).touch()
            process = subprocess.Popen(
                [sys.executable, "-m", "conformance.tp.rank", str(to_child_read), str(from_child_write)],
                pass_fds=(to_child_read, from_child_write), stdin=subprocess.DEVNULL, env=environment, start_new_session=True,
            )
            os.close(to_child_read)
            os.close(from_child_write)
            member = _Rank(rank, process, Connection(to_child_write, readable=False), Connection(from_child_read, writable=False), stack_file)
            self._ranks.append(member)
            member.send({
                "target": self.target_name, "rank": rank, "world_size": self.tp_size, "torch_threads": self.torch_threads,
                "init_file": os.path.join(self._directory, "process-group"), "stack_file": stack_file, "parent_pid": os.getpid(),
                "device_env": self.device_env if self.devices else None, "device": self.devices[rank] if self.devices else None,
            })
        replies = self._collect(START_TIMEOUT, "loading the target and joining the process group", "the rank start-up limit")
        self.device = replies[0]

    def run(self, case, timeout: float | None) -> list:
        """Every rank's answer to ``case``, by rank; raises :class:`RankFailure` (and ends the pool) when a rank fails."""
        self.start()
        for member in self._ranks:
            try:
                member.send(("case", case))
            except OSError:
                pass  # it died between cases: _collect reports it
        return self._collect(timeout, "running this case", "--case-timeout")

    def _collect(self, timeout: float | None, doing: str, limit: str) -> list:
        """Every rank's answer, by rank; on any failure the pool is ended and :class:`RankFailure` raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answers: dict[int, object] = {}
        pending = {member.replies: member for member in self._ranks}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), remaining)
            if not ready:
                self._timed_out(sorted(m.rank for m in pending.values()), timeout, doing, limit)
            for connection in ready:
                member = pending.pop(connection)
                try:
                    kind, value = pickle.loads(connection.recv_bytes())
                except (EOFError, OSError):
                    self._crashed(member, doing)
                if kind == "ok" or kind == "ready":
                    answers[member.rank] = value
                    continue
                crashed = self._dead_peer()
                if crashed is not None:
                    self._crashed(crashed, doing)
                self.close(kill=True)
                if kind == "not_supported":
                    raise RankFailure(None, f"rank {member.rank} raised NotImplementedError: {value}", (member.rank,))
                raise RankFailure(FailureKind.RAISED, f"rank {member.rank} of {self.tp_size} raised while {doing}: {value}", (member.rank,))
        return [answers[rank] for rank in range(self.tp_size)]

    def _dead_peer(self) -> _Rank | None:
        """A rank that exited, if one did shortly after another raised (its peers' errors are then its echo)."""
        deadline = time.monotonic() + CRASH_GRACE
        while time.monotonic() < deadline:
            for member in self._ranks:
                if member.process.poll() is not None:
                    return member
            time.sleep(0.05)
        return None

    def _crashed(self, member: _Rank, doing: str) -> None:
        try:
            returncode = member.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            member.process.kill()
            returncode = member.process.wait()
        where = member.frames()
        self.close(kill=True)
        raise RankFailure(
            FailureKind.CRASHED,
            f"rank {member.rank} of {self.tp_size} {describe_exit(returncode)} while {doing}; every rank was ended and the "
            f"next case starts a new pool" + (f"; its last Python frames: {where}" if where else "; it left no Python stack"),
            (member.rank,),
        )

    def _timed_out(self, ranks: list[int], timeout: float | None, doing: str, limit: str) -> None:
        for member in self._ranks:
            if member.process.poll() is None:
                try:
                    os.kill(member.process.pid, STACK_DUMP_SIGNAL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STACK_DUMP_WAIT
        while time.monotonic() < deadline and not all("File" in Path(self._ranks[r].stack_file).read_text(errors="replace") for r in ranks):
            time.sleep(0.05)
        frames = {r: self._ranks[r].frames() for r in ranks}
        # a rank blocked in a collective is waiting for a peer: the peers that are elsewhere are the ones that hang
        waiting = [r for r in ranks if "collectives.py" in frames[r]]
        stuck = [r for r in ranks if r not in waiting] or ranks
        where = [f"rank {r} at {frames[r]}" for r in stuck if frames[r]]
        if waiting and stuck != ranks:
            where.append(f"rank(s) {', '.join(map(str, waiting))} waiting in a collective for the others")
        self.close(kill=True)
        raise RankFailure(
            FailureKind.TIMED_OUT,
            f"rank(s) {', '.join(map(str, stuck))} of {self.tp_size} did not finish within {timeout:g} s while {doing} ({limit}); "
            "every rank was killed and the next case starts a new pool" + (f"; {'; '.join(where)}" if where else ""),
            tuple(stuck),
        )

    def close(self, kill: bool = False) -> None:
        """End every rank (asked to exit, or killed) and remove the pool's files."""
        ranks, self._ranks = self._ranks, []
        for member in ranks:
            if not kill and member.process.poll() is None:
                try:
                    member.send(("exit", None))
                except OSError:
                    pass
        for member in ranks:
            if not kill:
                try:
                    member.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if member.process.poll() is None:
                member.process.kill()
            member.process.wait()
            member.commands.close()
            member.replies.close()
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
