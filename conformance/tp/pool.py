"""A pool of rank processes, one per tensor-parallel rank, kept alive across the cases of one TP size.

Starting a rank costs a Python process with torch and the target loaded (about a second on a CPU,
more with a device runtime), so a pool is started once per TP size and serves every case of that size.
When a case goes wrong the pool cannot be trusted any more (a collective may be half done on some
ranks): a rank that dies or does not answer within the case timeout ends the whole pool, the case is
recorded (:class:`RankFailure`), and the next case starts a fresh pool. A rank that raises (or raises
``NotImplementedError``) ends it too, unless every other rank answers the same case within
``STEP_GRACE`` seconds: then no collective is half done and the pool serves the next case. Each rank is a
:class:`conformance.isolation.worker.WorkerProcess`, as the op worker is: spawned (never forked), the
parent's environment and ``sys.path``, a session and process group of its own, dying with its parent;
a hung rank is asked for its Python stacks (SIGUSR1) before it is killed, so the record says where it
was; ending a rank ends its whole process group, and what the target left running there is kept in
``RankPool.leftover_processes``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from multiprocessing.connection import wait

from conformance.isolation.protocol import Reply, Tag
from conformance.isolation.worker import STACK_DUMP_WAIT, WorkerProcess, describe_exit, describe_leftovers
from conformance.targets.device_traits import DeviceTraits
from conformance.text import TRACEBACK_LIMIT, safe_text
from conformance.verdict import FailureKind
from conformance.wire import Limits, WireError, from_data

from .layer_wire import RankAnswer, answer_limits, read_answer, request
from .placement import Placement, place_ranks

START_TIMEOUT = 600.0  # seconds for every rank to load torch and the target and join the process group
CRASH_GRACE = 0.5  # after a rank raises, how long to look whether a peer died (its death is the cause)
STEP_GRACE = 2.0  # after a rank raises, how long the others have to answer the case too, so the pool can stay

__all__ = ["CRASH_GRACE", "START_TIMEOUT", "STACK_DUMP_WAIT", "RankFailure", "RankPool"]


class RankFailure(Exception):
    """A case ended on some rank without an answer: ``kind`` raised / crashed / timed out, or ``None`` for
    a ``NotImplementedError`` (not supported). ``ranks`` are the ranks it names; ``traceback`` what the
    rank raised, formatted in the rank's process, and ``raised`` its type and the innermost frame of the
    target's code (both None for a crash or a hang: nothing was raised)."""

    def __init__(self, kind: FailureKind | None, message: str, ranks: tuple[int, ...] = (), traceback: str | None = None,
                 raised: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.ranks, self.traceback, self.raised = kind, message, ranks, traceback, raised


READY_LIMITS = Limits(header_bytes=1 << 20, tensor_bytes=0, tensors=0)


def _answered(member: WorkerProcess) -> bool:
    """Whether an exited rank left an answer in its pipe (read here: the pool is ending) rather than only its end."""
    try:
        while member.poll(0):
            if member.read(READY_LIMITS).tag != Tag.COLLECTIVE:
                return True
    except (EOFError, OSError, WireError, TimeoutError):
        return False
    return False


class RankPool:
    """``tp_size`` rank processes of one target; ``run(case, timeout)`` returns rank 0's gathered output.

    ``placement``: each rank's device and the backend joining them (``conformance.tp.placement``); by
    default every rank on the CPU with gloo.
    """

    def __init__(self, target_name: str, tp_size: int, *, torch_threads: int = 1, placement: Placement | None = None) -> None:
        self.placement = placement or place_ranks(tp_size, None, DeviceTraits.builtin("cpu"), None)
        if len(self.placement.devices) != tp_size:
            raise ValueError(f"a placement of {len(self.placement.devices)} ranks for a pool of {tp_size}")
        self.target_name, self.tp_size, self.torch_threads = target_name, tp_size, torch_threads
        self._ranks: list[WorkerProcess] = []  # by rank
        self._directory: str | None = None
        self.device: dict | None = None  # rank 0's device description, once the pool started
        self._seq = 0  # cases sent: each answer must echo its call's number
        self._in_collective: dict[int, bool] = {}  # rank → whether its last word was "in a collective"
        self.starts = 0
        # processes a target started and left running in a rank's process group, found when the ranks were
        # ended (after a failure, or at close) and killed with them: "pid N (command)"
        self.leftover_processes: list[str] = []

    @property
    def alive(self) -> bool:
        return bool(self._ranks)

    def leftover_description(self) -> str:
        """What a record says about ``leftover_processes``: "the target left N process(es) running: …; they were killed", or ""."""
        return describe_leftovers(self.leftover_processes)

    def start(self) -> None:
        """Start every rank and wait until each has loaded the target and joined the process group."""
        if self._ranks:
            return
        self.starts += 1
        self._directory = tempfile.mkdtemp(prefix=f"lora-conformance-tp{self.tp_size}-")
        placement = self.placement
        for rank in range(self.tp_size):
            env = placement.env(rank)
            member = WorkerProcess()
            self._ranks.append(member)
            member.spawn(
                "conformance.tp.rank",
                {
                    "target": self.target_name, "rank": rank, "world_size": self.tp_size, "torch_threads": self.torch_threads,
                    "init_file": os.path.join(self._directory, "process-group"), "backend": placement.backend,
                    "device_env": placement.variable if env else None, "device": placement.devices[rank],
                },
                # the rank's device is in its environment from the start, before any device runtime loads
                env_updates=env,
            )  # fmt: skip
        replies = self._collect(START_TIMEOUT, "loading the target and joining the process group", "the rank start-up limit",
                                None, lambda rank: READY_LIMITS, self._ready)
        self.device = replies[0]

    @staticmethod
    def _ready(message, rank: int) -> dict:
        if message.tag != Tag.READY:
            raise WireError(f"rank {rank}'s first message is {message.tag[:40]!r}, not ready")
        return from_data(dict[str, dict[str, str]], message.body, "ready")["device"]

    def run(self, case, tensors, timeout: float | None) -> list[RankAnswer]:
        """Every rank's answer to ``case`` on ``tensors`` (its unsharded tensors, drawn by the referee), by rank;
        raises :class:`RankFailure` (and ends the pool) when a rank fails."""
        return self.call(case.case_id, request(case, tensors), answer_limits(case), read_answer, timeout)

    def call(self, case_id: str, sent: dict, limits: Limits, read, timeout: float | None) -> list:
        """Every rank's answer to the request ``sent`` for case ``case_id``, each read within ``limits`` and taken by
        ``read(data, rank)`` (``WireError`` for what it refuses), by rank; :class:`RankFailure` as for :meth:`run`."""
        self.start()
        self._seq += 1
        seq = self._seq
        self._in_collective = {}
        for member in self._ranks:
            try:
                member.send(Tag.CALL, {"seq": seq, "level": "layer", "half": "conformance.tp.rank", "case_id": case_id, "request": sent})
            except (OSError, TimeoutError):
                pass  # it died (or stopped reading) between cases: _collect reports it

        def answer(message, rank: int) -> RankAnswer:
            if message.tag != Tag.OK:
                raise WireError(f"the tag {message.tag[:40]!r} answers no call")
            reply = from_data(Reply, message.body, f"rank {rank}'s reply")
            if (reply.seq, reply.case_id) != (seq, case_id):
                raise WireError(f"rank {rank} answers call {reply.seq} for case {reply.case_id[:200]!r}, not call {seq} "
                                f"for this case ({case_id!r})")
            return read(reply.reply, rank)

        return self._collect(timeout, "running this case", "--case-timeout", seq, lambda rank: limits, answer)

    def _collect(self, timeout: float | None, doing: str, limit: str, seq: int | None, limits, accept) -> list:
        """Every rank's answer, by rank, each read within ``limits(rank)`` and taken by ``accept(message, rank)``
        (``WireError`` for what it refuses); on any failure the pool is ended and :class:`RankFailure` raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answers: dict[int, object] = {}
        pending = {member.connection: rank for rank, member in enumerate(self._ranks)}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), remaining)
            if not ready:
                self._timed_out(sorted(pending.values()), timeout, doing, limit)
            for connection in ready:
                rank = pending.pop(connection)
                member = self._ranks[rank]
                try:
                    message = member.read(limits(rank))
                except (EOFError, OSError):
                    self._crashed(rank, doing)
                except (WireError, TimeoutError) as exc:
                    self._refused(rank, str(exc) if isinstance(exc, WireError) else "its answer stopped arriving midway", doing)
                if message.tag == Tag.COLLECTIVE:  # a word on the way: the rank is still at the case
                    state = message.body if isinstance(message.body, dict) else {}
                    if state.get("seq") == seq and isinstance(state.get("in"), bool):
                        self._in_collective[rank] = state["in"]
                    pending[connection] = rank
                    continue
                if message.tag in (Tag.RAISE, Tag.NOT_SUPPORTED):
                    self._failed(rank, message, seq, doing, pending, limits)
                try:
                    answers[rank] = accept(message, rank)
                except WireError as exc:
                    self._refused(rank, str(exc), doing)
        return [answers[rank] for rank in range(self.tp_size)]

    def _failed(self, rank: int, message, seq: int | None, doing: str, pending: dict, limits) -> None:
        """A rank raised (or its wrapper raised NotImplementedError): the failure is raised, and the pool ends unless
        every other rank answered this case too (:meth:`_in_step`)."""
        try:
            reply = from_data(Reply, message.body, f"rank {rank}'s reply")
        except WireError as exc:
            self._refused(rank, str(exc), doing)
        crashed = self._dead_peer(rank)
        if crashed is not None:
            self._crashed(crashed, doing)
        if not self._in_step(pending, seq, limits):
            self.close(kill=True)
        if message.tag == Tag.NOT_SUPPORTED:
            raise RankFailure(None, f"rank {rank} raised NotImplementedError: {safe_text(reply.message)}", (rank,))
        error = reply.error
        text = safe_text(error.text) if error else "an error without its text"
        traceback = safe_text(error.traceback, TRACEBACK_LIMIT) if error and error.traceback else None
        raise RankFailure(FailureKind.RAISED, f"rank {rank} of {self.tp_size} raised while {doing}: {text}", (rank,), traceback,
                          error.raised if error else None)

    def _refused(self, rank: int, what: str, doing: str) -> None:
        self.close(kill=True)
        raise RankFailure(FailureKind.MALFORMED_REPLY, f"the reply of rank {rank} of {self.tp_size} was refused while {doing}: "
                          f"{what}; nothing in it was judged, every rank was killed and the next case starts a new pool", (rank,))

    def _in_step(self, pending: dict, seq: int | None, limits) -> bool:
        """After a rank raised in a case (not while the pool starts: such a rank exits): whether every rank still
        ``pending`` answers this case too within ``STEP_GRACE`` seconds (raised, refused or finished), none left
        in a collective. Then every rank is back in its loop and the pool serves the next case: a port whose
        sharded path raises in every case costs one pool start (``tp_size`` imports of its framework), not one
        per case."""
        if seq is None:
            return False
        deadline = time.monotonic() + STEP_GRACE
        pending = dict(pending)
        while pending:
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            for connection in ready:
                rank = pending.pop(connection)
                try:
                    message = self._ranks[rank].read(limits(rank))
                    if message.tag == Tag.COLLECTIVE:
                        pending[connection] = rank
                        continue
                    if from_data(Reply, message.body, f"rank {rank}'s reply").seq != seq:
                        return False
                except (EOFError, OSError, WireError, TimeoutError):
                    return False
        return True

    def _dead_peer(self, raised: int) -> int | None:
        """A rank that died without an answer shortly after ``raised`` raised (its peers' errors are then its echo).

        Not ``raised`` itself, nor a rank whose answer is waiting in its pipe: a rank that raises while the
        pool starts answers, then exits by design (``conformance.tp.rank``), and its exit is no crash."""
        deadline = time.monotonic() + CRASH_GRACE
        answered = {raised}  # an answer is read once: remembered, as the pipe then holds only its end
        while time.monotonic() < deadline:
            for rank, member in enumerate(self._ranks):
                if rank in answered or member.alive:
                    continue
                if not _answered(member):
                    return rank
                answered.add(rank)
            time.sleep(0.05)
        return None

    def _crashed(self, rank: int, doing: str) -> None:
        member = self._ranks[rank]
        returncode = member.exit_status()
        where = member.frames()
        self.close(kill=True)
        raise RankFailure(
            FailureKind.CRASHED,
            f"rank {rank} of {self.tp_size} {describe_exit(returncode)} while {doing}; every rank was ended and the "
            f"next case starts a new pool" + (f"; its last Python frames: {where}" if where else "; it left no Python stack"),
            (rank,),
        )

    def _timed_out(self, ranks: list[int], timeout: float | None, doing: str, limit: str) -> None:
        for member in self._ranks:
            member.dump_stacks()
        deadline = time.monotonic() + STACK_DUMP_WAIT
        while time.monotonic() < deadline and not all(self._ranks[r].has_stacks() for r in ranks):
            time.sleep(0.05)
        frames = {r: self._ranks[r].frames() for r in ranks}
        # a rank in a collective (its own word, over its pipe) waits for a peer: the peers elsewhere are the ones that hang
        waiting = [r for r in ranks if self._in_collective.get(r)]
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
        """End every rank (asked to exit, or killed) and its process group, and remove the pool's files.
        Processes a target left in a rank's group are added to ``leftover_processes``."""
        ranks, self._ranks = self._ranks, []
        if not kill:
            for member in ranks:  # all at once: each ends while the others are asked
                member.ask_to_exit()
        for member in ranks:
            self.leftover_processes.extend(member.stop(kill=kill))
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
