"""The tensors of a tensor-parallel case (the unsharded layer), and each rank's shard of them.

The referee draws the whole problem from the case's seed (here, in its own process: a rank runs the
target's code, which must not reach the drawing) and hands every rank the whole of it as data; each rank
cuts its own shard, as vLLM's ``slice_lora_a`` / ``slice_lora_b`` cut the full adapter each rank loads. Magnitudes as for op cases
(``conformance.cases.values``): activations ~ N(0, 1), LoRA-A scaled by 1/√H, LoRA-B by 1/√R, so every
intermediate stays O(1) in float16. Stacks are 4-D ``[L, 1, rows, cols]``, the layout vLLM's layers
keep; slots no token uses still hold non-zero weights, so a row reading the wrong slot shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conformance.cases.case import DTYPES

from .case import TPCase

Stacks = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LayerTensors:
    """The unsharded layer: activations ``x [T, H]``, per slice ``A [L, 1, R, H]`` and ``B [L, 1, N_s, R]``,
    and the output ``y [T, Σ N_s]`` as it is before the LoRA delta (the base layer's output)."""

    x: torch.Tensor
    lora_a: Stacks
    lora_b: Stacks
    y: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LayerTensors:
        """Every tensor through ``fn``."""
        return LayerTensors(fn(self.x), tuple(map(fn, self.lora_a)), tuple(map(fn, self.lora_b)), fn(self.y))

    def to(self, dtype: torch.dtype) -> LayerTensors:
        return self.map(lambda tensor: tensor.to(dtype))

    def on(self, device: torch.device) -> LayerTensors:
        return self.map(lambda tensor: tensor.to(device))

    def named(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every tensor by a name of its own: ``x``, ``y``, ``lora_a.<slice>``, ``lora_b.<slice>`` (after ``prefix``)."""
        named = {f"{prefix}x": self.x, f"{prefix}y": self.y}
        named.update({f"{prefix}lora_a.{s}": a for s, a in enumerate(self.lora_a)})
        named.update({f"{prefix}lora_b.{s}": b for s, b in enumerate(self.lora_b)})
        return named


def layer_tensors(case: TPCase) -> LayerTensors:
    """The case's tensors in its dtype (drawn in float64 from its seed, then rounded once)."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    tokens, slots, rank, hidden = case.num_tokens, case.num_slots, case.max_rank, case.hidden_size

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x = draw(tokens, hidden)
    lora_a = tuple(draw(slots, 1, rank, hidden, scale=hidden**-0.5) for _ in case.output_slices)
    lora_b = tuple(draw(slots, 1, width, rank, scale=rank**-0.5) for width in case.output_slices)
    y = draw(tokens, case.output_width)
    return LayerTensors(x, lora_a, lora_b, y)


def column_bounds(case: TPCase) -> list[int]:
    """Where each slice starts in the unsharded output, and where the last ends: ``[0, N_0, N_0 + N_1, …]``."""
    bounds = [0]
    for width in case.output_slices:
        bounds.append(bounds[-1] + width)
    return bounds


def rank_columns(case: TPCase, rank: int) -> list[tuple[int, int]]:
    """The unsharded output columns ``[start, end)`` that hold ``rank``'s part, slice by slice.

    Column layers: each slice's shard ``N_s / shards_s`` wide at ``start_s + shard · N_s / shards_s``
    (vLLM's ``slice_lora_b``: slice by slice for merged and QKV layers; the shard is the rank, or the
    ``kv_shard_id`` of replicated heads, ``case.shard_of``). Fully sharded row layers: the rank's
    LoRA-B rows ``[rank · N / tp, (rank + 1) · N / tp)``. A row layer that is not fully sharded has
    every rank add to every column (its delta is a partial sum): all of them.
    """
    if case.layer == "row" and not case.fully_sharded:
        return [(0, case.output_width)]
    bounds = column_bounds(case)
    parts = []
    for s, (width, shards) in enumerate(zip(case.output_slices, case.slice_shards)):
        shard, index = width // shards, case.shard_of(s, rank)
        parts.append((bounds[s] + index * shard, bounds[s] + (index + 1) * shard))
    return parts


def in_replica(case: TPCase, s: int, rank: int, replica: int) -> bool:
    """Whether ``rank``'s shard of slice ``s`` is part of replica group ``replica``'s output: every rank's
    shard of a slice no two ranks share (q, gate, every slice of a layer without replicated heads); of a
    slice shared by ``n`` ranks, only the shard of the ranks ``r`` with ``r % n == replica % n``, one per
    head (:func:`replica_sources`)."""
    replicas = case.slice_replicas[s]
    return rank % replicas == replica % replicas


def replica_sources(case: TPCase, replica: int) -> str:
    """Which ranks supply the replicated slices of replica group ``replica``: "k, v from ranks 1, 3"."""
    sources: dict[tuple[int, ...], list[str]] = {}
    for s, replicas in enumerate(case.slice_replicas):
        if replicas > 1:
            ranks = tuple(r for r in range(case.tp_size) if in_replica(case, s, r, replica))
            sources.setdefault(ranks, []).append(case.slice_name(s))
    return "; ".join(f"{', '.join(names)} from rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                     for ranks, names in sources.items())


def column_shard(tensor: torch.Tensor, case: TPCase, rank: int) -> torch.Tensor:
    """``rank``'s columns of an unsharded output ``[T, Σ N_s]``, packed slice after slice (its local output)."""
    return torch.cat([tensor[:, start:end] for start, end in rank_columns(case, rank)], dim=1).contiguous()


def place_column_shards(case: TPCase, shards: list[torch.Tensor], into: torch.Tensor, replica: int = 0) -> torch.Tensor:
    """The unsharded output from every rank's packed columns (the inverse of :func:`column_shard`). With
    replicated heads, several ranks hold the same columns: ``replica`` says whose are placed."""
    out = into.clone()
    for rank, shard in enumerate(shards):
        local = 0
        for s, (start, end) in enumerate(rank_columns(case, rank)):
            if in_replica(case, s, rank, replica):
                out[:, start:end] = shard[:, local : local + end - start]
            local += end - start
    return out


def lora_b_rows(stacks: Stacks, case: TPCase, rank: int) -> Stacks:
    """Each slice's LoRA-B rows (output features) that ``rank`` holds: ``[L, 1, N_s / shards_s, R]``."""
    parts = []
    for s, (stack, width, shards) in enumerate(zip(stacks, case.output_slices, case.slice_shards)):
        shard, index = width // shards, case.shard_of(s, rank)
        parts.append(stack[:, :, index * shard : (index + 1) * shard, :].contiguous())
    return tuple(parts)


def lora_a_rank_rows(stacks: Stacks, case: TPCase, rank: int) -> Stacks:
    """Fully sharded column layers: each slice's LoRA-A rows of the LoRA rank ``rank`` holds, ``[L, 1, R / tp, H]``."""
    shard = case.max_rank // case.tp_size
    return tuple(stack[:, :, rank * shard : (rank + 1) * shard, :].contiguous() for stack in stacks)


def input_columns(case: TPCase, rank: int) -> slice:
    """Row layers: the input features ``rank`` holds (``x``'s columns, LoRA-A's columns)."""
    shard = case.hidden_size // case.tp_size
    return slice(rank * shard, (rank + 1) * shard)


def column_ranges(columns, limit: int) -> str:
    """``"0–3, 8, 10–11"``: sorted columns as runs, at most ``limit`` runs shown."""
    runs: list[list[int]] = []
    for c in sorted(set(columns)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    shown = [f"{a}" if a == b else f"{a}–{b}" for a, b in runs[:limit]]
    return ", ".join(shown) + (", …" if len(runs) > limit else "")


def rank_shard(case: TPCase, t: LayerTensors, rank: int) -> LayerTensors:
    """What ``rank`` holds of the unsharded layer ``t``, as vLLM's layers cut it: column layers keep ``x`` whole,
    LoRA-A whole (its R / tp rows when fully sharded), their slices' LoRA-B rows and output columns; row layers
    keep their input features of ``x`` and LoRA-A, LoRA-B whole (its N / tp rows when fully sharded) and the
    base output's partial sum (all of it on rank 0, zeros elsewhere)."""
    if case.layer == "row":
        cols = input_columns(case, rank)
        lora_b = lora_b_rows(t.lora_b, case, rank) if case.fully_sharded else t.lora_b
        y = t.y.clone() if rank == 0 else torch.zeros_like(t.y)
        return LayerTensors(t.x[:, cols].contiguous(), tuple(a[..., cols].contiguous() for a in t.lora_a), lora_b, y)
    lora_a = lora_a_rank_rows(t.lora_a, case, rank) if case.fully_sharded else t.lora_a
    return LayerTensors(t.x, lora_a, lora_b_rows(t.lora_b, case, rank), column_shard(t.y, case, rank))
