"""The grouped fused-MoE LoRA: the pairs sorted by (slot, expert) into fixed-size blocks, one weight gather per block.

The mask variant multiplies every (token, choice) pair by every (slot, expert) (``L·E`` times the LoRA
work) and the gather variant copies every pair's own weights (``P·R·(K + N)`` elements). This variant
does the grouped work with static shapes. For ``P`` padded pairs, ``G = L·E`` groups (one per
(slot, expert); ``G = L`` when every stack is shared) and a block size ``b``:

1. **key** of pair ``p``: ``slot·E + expert`` when it is served (slot ≠ −1, adapter enabled, local expert),
   else ``G`` (a bin of its own that owns no block);
2. **sort**: ``argsort`` of the keys; a pair's rank inside its group is its sorted position minus the
   group's first position (exclusive cumulative counts). Group ``g`` owns ``⌈c_g / b⌉`` blocks starting
   at block ``Σ_{j<g} ⌈c_j / b⌉``, and the pair lands at ``first_block_g·b + rank``;
3. **one weight gather per block**: block ``k``'s group is the key of its first pair (every used block
   starts with a real pair); its A ``[R, K]`` and B ``[N, R]`` are gathered once, ``[B, R, K]`` / ``[B, N, R]``;
4. **batched products**: ``x`` gathered into the block layout ``[B, b, K]`` (empty positions read a zero
   row), ``bmm`` with A, the intermediate rounded to the weight dtype, ``bmm`` with B: ``[B, b, N]``;
5. **back to the pairs** with a gather (each pair's position), routing weight applied to the float32 delta;
   ``writeback`` keeps the output rows of unserved pairs bit-identical (they read a clamped position).

**Static shapes.** The number of blocks a batch uses depends on the routing, so the shape is its bound:
each non-empty group wastes fewer than ``b`` positions and at most ``m = min(G, P)`` groups are non-empty,
so ``Σ_g ⌈c_g / b⌉ ≤ ⌊(P + m·(b − 1)) / b⌋ = B``. ``P`` is the token bucket times ``top_k``, so ``b`` and
``B`` (:func:`block_shape`) are fixed per bucket: one graph per bucket, whatever the routing or the
adapter mix. Unused blocks compute padding (zero rows against some (slot, expert)'s weights) and are
never read back.

**The block size** trades wasted rows against weight gathers: ``B·b ≤ P + m·(b − 1)`` rows are multiplied
(the static work), ``B`` weight matrices are gathered. ``b`` is the largest power of two with
``m·(b − 1) ≤ P / 2``, at most 128: at most 1.5 × the padded pairs' rows, so at most 2 × the grouped
FLOPs when three pairs in four are served. Decode (``P ≪ G``) gets ``b = 1``: each pair its own block,
the gather variant's work; large batches get blocks of 16–128 pairs, whose weights are read once per
block instead of once per pair.

**No host synchronisation**: the counts, orders and positions stay on the device; the only host values
are ``b`` and ``B``, functions of the bucket. Weights are gathered from the stacks in their own dtype and
upcast per block (or upcast whole and then gathered, when there are more blocks than matrices), so nothing
is cached and no float32 copy of the stacks is kept (the mask and gather variants keep one per adapter set). The sort uses ``argsort`` (int64 indices: ``scatter`` needs them).

**NaN isolation.** A block holds the pairs of one (slot, expert) and zero rows; rows of a ``bmm`` are
independent, so a non-finite weight reaches only the pairs routed to that very (slot, expert) (the mask
variant's dense expand lets a used slot's Inf meet other rows' zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rows import RoutedPairs
from .stacks import accumulation_dtype, experts_as_slots, experts_of

MAX_BLOCK = 128  # a cap, not a tuned value: by then B is close to the group count and larger blocks save few gathers


@dataclass(frozen=True)
class BlockShape:
    """The static block layout of one bucket: ``blocks`` blocks of ``block`` pair positions."""

    pairs: int  # P: padded pairs (token bucket × top_k)
    groups: int  # G: (slot, expert) groups
    block: int  # b
    blocks: int  # B

    @property
    def positions(self) -> int:
        return self.blocks * self.block


def block_shape(pairs: int, groups: int, max_block: int = MAX_BLOCK) -> BlockShape:
    """``b``, the largest power of two ≤ ``max_block`` with ``min(G, P)·(b − 1) ≤ P / 2``, and the bound ``B``."""
    if pairs < 1 or groups < 1:
        raise ValueError(f"a block layout needs pairs and groups, got {pairs} pairs, {groups} groups")
    nonempty = min(groups, pairs)
    block = 1
    while block * 2 <= max_block and nonempty * (block * 2 - 1) * 2 <= pairs:
        block *= 2
    return BlockShape(pairs, groups, block, (pairs + nonempty * (block - 1)) // block)


def block_plan(
    slots: torch.Tensor, experts: torch.Tensor, served: torch.Tensor, experts_per_slot: int, groups: int, block: int, blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each pair goes: ``(pair_at [B·b], position [P], block_group [B])``.

    ``pair_at[j]``: the pair at block position ``j``, ``P`` where it is empty; ``position[p]``: pair ``p``'s
    block position, ``B·b`` when it is not served; ``block_group[k]``: block ``k``'s group, ``G`` when unused.
    """
    pairs = slots.numel()
    expert = experts.long() if experts_per_slot > 1 else torch.zeros_like(experts, dtype=torch.long)
    keys = torch.where(served, slots.long() * experts_per_slot + expert, groups)
    counts = torch.zeros(groups + 1, dtype=torch.long, device=keys.device).scatter_add(0, keys, torch.ones_like(keys))
    group_blocks = (counts[:groups] + block - 1) // block
    first_block = torch.cumsum(group_blocks, 0) - group_blocks
    first_pair = torch.cumsum(counts, 0) - counts  # the group's first sorted position
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    rank = torch.arange(pairs, device=keys.device) - first_pair[sorted_keys]
    sorted_position = torch.where(
        sorted_keys < groups, first_block[sorted_keys.clamp(max=groups - 1)] * block + rank, blocks * block
    )
    position = torch.empty_like(keys).scatter(0, order, sorted_position)
    # Every unserved pair is written to the one dump position past the end, then cut off.
    pair_at = torch.full((blocks * block + 1,), pairs, dtype=torch.long, device=keys.device)
    pair_at = pair_at.scatter(0, sorted_position, order)[: blocks * block]
    block_group = F.pad(keys, (0, 1), value=groups)[pair_at[::block]]
    return pair_at, position, block_group


def block_rows(x: torch.Tensor, pair_at: torch.Tensor, pairs_per_row: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The inputs in the block layout ``[B, b, K]`` in ``dtype``: pair ``p`` reads row ``p // pairs_per_row``, empty positions a zero row."""
    rows = torch.div(pair_at, pairs_per_row, rounding_mode="floor").clamp(max=x.size(0))
    padded = F.pad(x.to(dtype), (0, 0, 0, 1))  # row x.size(0): zeros
    return padded.index_select(0, rows).unflatten(0, (-1, block))


def stack_index(block_group: torch.Tensor, experts_per_slot: int, stack_experts: int, stack_slots: int) -> torch.Tensor:
    """Each block's matrix in a stack seen as ``[L·E_s, rows, cols]``: ``slot·E_s + expert`` (``slot`` when shared).

    Unused blocks (group ``G``, slot ``L``) read the last matrix: their rows are padding, never read back."""
    slot = torch.div(block_group, experts_per_slot, rounding_mode="floor")
    index = slot * stack_experts + (block_group % experts_per_slot if stack_experts > 1 else 0)
    return index.clamp(max=stack_slots * stack_experts - 1)


def block_weights(stack: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stack[index]`` in ``dtype``: each block's matrix. The cheaper order, fixed per bucket (both sizes are
    static): with more blocks than matrices, upcast every matrix once and gather; else gather, then upcast."""
    if index.numel() >= stack.size(0):
        return stack.to(dtype).index_select(0, index)
    return stack.index_select(0, index).to(dtype)


def slice_delta(
    x_blocks: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    block_group: torch.Tensor,
    experts_per_slot: int,
    num_slots: int,
    position: torch.Tensor,
    weight_dtype: torch.dtype,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One slice's delta ``[P, N]`` in the weight dtype: per block ``round(x_b @ A_gᵀ) @ B_gᵀ``, back to the pairs
    (rows of unserved pairs hold anything: the caller's write-back must not use them).

    ``a_stack`` ``[L·E_a, R, K]`` and ``b_stack`` ``[L·E_b, N, R]`` (``E_a``, ``E_b``: ``E`` or 1 when shared) in their own dtype; ``x_blocks`` already
    in the accumulation dtype. Rounding as vLLM's kernels: float32 accumulation, the intermediate rounded
    to the weight dtype (``CAST_TYPE``), the routing weight applied before the delta is rounded.
    """
    acc = x_blocks.dtype
    a_index = stack_index(block_group, experts_per_slot, a_stack.size(0) // num_slots, num_slots)
    b_index = stack_index(block_group, experts_per_slot, b_stack.size(0) // num_slots, num_slots)
    a = block_weights(a_stack, a_index, acc)  # [B, R, K]: one matrix per block
    shrunk = torch.bmm(x_blocks, a.transpose(1, 2))  # [B, b, R]
    shrunk = shrunk.to(weight_dtype).to(acc)
    b = block_weights(b_stack, b_index, acc)  # [B, N, R]
    delta_blocks = torch.bmm(shrunk, b.transpose(1, 2))  # [B, b, N]
    positions = delta_blocks.size(0) * delta_blocks.size(1)
    delta = delta_blocks.reshape(positions, -1).index_select(0, position.clamp(max=positions - 1))  # [P, N]
    if row_weight is not None:
        delta = delta * row_weight.to(acc)[:, None]
    # Unserved pairs read some block position (clamped): whatever it holds, ``writeback.merge`` keeps their
    # output rows (``torch.where`` on the served pairs), so no pass over [P, N] is spent zeroing them here.
    return delta.to(weight_dtype)


class GroupedMoE:
    """The engine's MoE math of this variant: the pure functions above, each in the device layer's form."""

    name = "grouped"

    def __init__(self, prepare, max_block: int = MAX_BLOCK) -> None:
        self.max_block = max_block
        self._plan = prepare(block_plan)
        self._rows = prepare(block_rows)
        self._delta = prepare(slice_delta)

    def deltas(
        self,
        x: torch.Tensor,
        a_stacks: tuple[torch.Tensor, ...],
        b_stacks: tuple[torch.Tensor, ...],
        pairs: RoutedPairs,
        pairs_per_row: int,
        row_weight: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """Each slice's delta ``[P_pad, N]``; ``x`` is padded (``P_pad / pairs_per_row`` rows), ``row_weight`` ``[P_pad]`` or ``None``."""
        stacks = (*a_stacks, *b_stacks)
        experts = max(experts_of(s) for s in stacks)
        num_slots = a_stacks[0].size(0)
        shape = block_shape(pairs.padded, num_slots * experts, self.max_block)
        pair_at, position, block_group = self._plan(pairs.slots, pairs.experts, pairs.served, experts, shape.groups,
                                                    shape.block, shape.blocks)
        x_blocks = self._rows(x, pair_at, pairs_per_row, shape.block, accumulation_dtype(x, *stacks))
        result = []
        for a_stack, b_stack in zip(a_stacks, b_stacks, strict=True):
            result.append(self._delta(x_blocks, experts_as_slots(a_stack), experts_as_slots(b_stack), block_group, experts,
                                      num_slots, position, b_stack.dtype, row_weight))
        return result
