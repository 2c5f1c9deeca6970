"""The two collectives vLLM's sharded LoRA layers use, over real processes or simulated in one.

``tensor_model_parallel_all_gather(t, dim=-1)`` concatenates every rank's tensor along ``dim`` in rank
order; ``tensor_model_parallel_all_reduce(t)`` sums them. :class:`ProcessGroupCollectives` runs them
with ``torch.distributed`` (gloo, nccl or hccl) between the rank processes of ``conformance.tp.pool``
(gloo between ranks on a device joins host copies of their tensors: ``conformance.tp.placement``);
:class:`ThreadCollectives` runs the same composition with every rank as a thread of one process and
sums in rank order in the tensors' dtype. The baseline of a case (what a correct target computes in
the case dtype, partial sums rounded where the collective rounds them) is the reference wrapper run
through the thread version, so it is literally the composition the ranks run.
"""

from __future__ import annotations

import threading

import torch


class ProcessGroupCollectives:
    """The default ``torch.distributed`` process group of this rank process. ``report(inside)``, if given, is told
    when the rank enters (True) and leaves (False) a collective: the pool names a hung rank from it (a rank
    waiting in a collective waits for a peer; the peer elsewhere is the one that hangs)."""

    def __init__(self, rank: int, world_size: int, report=None, on_host: bool = False) -> None:
        self.rank, self.world_size = rank, world_size
        self.report = report or (lambda inside: None)
        # gloo (the CPU's backend, and the one ranks sharing a device fall back to: conformance.tp.placement) is
        # handed host copies, which it supports for every collective and dtype, and the result goes back to the
        # device the layer runs on; for CPU tensors both copies are no-ops
        self.on_host = on_host

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu").contiguous() if self.on_host else tensor.contiguous()

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        import torch.distributed as dist

        staged = self._staged(tensor)
        parts = [torch.empty_like(staged) for _ in range(self.world_size)]
        self.report(True)
        dist.all_gather(parts, staged)
        self.report(False)
        return torch.cat(parts, dim=dim).to(tensor.device)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        staged = self._staged(tensor)
        self.report(True)
        dist.all_reduce(staged)
        self.report(False)
        return staged.to(tensor.device)


class ThreadCollectives:
    """One per simulated rank; the ranks share ``board``, a barrier and a list of each rank's tensor."""

    def __init__(self, rank: int, board: ThreadBoard) -> None:
        self.rank, self.board = rank, board
        self.world_size = board.world_size

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.board.slots[self.rank] = tensor.clone()
        self.board.barrier.wait()
        parts = list(self.board.slots)
        self.board.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return parts

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part  # in the tensor's dtype, in rank order: one rounding per addition
        return total


class ThreadBoard:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size


def run_in_threads(world_size: int, per_rank) -> list:
    """``per_rank(rank, collectives)`` for every rank at once, each in a thread; their return values by rank.

    An exception in one rank breaks the barrier for the others and is raised here.
    """
    board = ThreadBoard(world_size)
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = per_rank(rank, ThreadCollectives(rank, board))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            board.barrier.abort()

    threads = [threading.Thread(target=body, args=(rank,), name=f"tp-rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:  # the rank that failed first, not the others' broken barriers
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
