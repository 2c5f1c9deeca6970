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
   starts with a real pair); its A ``[R, K]`` and B ``[N, R]`` are gathered once, ``[B, R, K]`` / ``[B, N, R]``,
   in the stacks' own dtype;
4. **batched products**: ``x`` gathered into the block layout ``[B, b, K]``, ``bmm`` with A, the intermediate
   rounded to the weight dtype, ``bmm`` with B: ``[B·b, N]``;
5. **back to the pairs**: ``writeback.merge_blocks`` adds (or copies) each block row into its pair's output
   row with ``index_add_`` on the static ``pair_at`` vector (empty positions write a dump row that is cut
   off), the routing weight applied to the float32 delta first. Rows of unserved pairs are never written,
   so they stay bit-identical without a ``torch.where`` over the output; only the slice's columns are touched.

**Static shapes.** The number of blocks a batch uses depends on the routing, so the shape is its bound:
each non-empty group wastes fewer than ``b`` positions and at most ``m = min(G, P)`` groups are non-empty,
so ``Σ_g ⌈c_g / b⌉ ≤ ⌊(P + m·(b − 1)) / b⌋ = B``. ``P`` is the token bucket times ``top_k``, so ``b`` and
``B`` (:func:`block_shape`) are fixed per bucket: one graph per bucket, whatever the routing or the
adapter mix. Unused blocks compute padding (some row of ``x`` against some (slot, expert)'s weights) and
are never read back.

**The block size** trades wasted rows against weight gathers: ``B·b ≤ P + m·(b − 1)`` rows are multiplied
(the static work), ``B`` weight matrices are gathered. ``b`` is the largest power of two with
``m·(b − 1) ≤ P / 2``, at most 128: at most 1.5 × the padded pairs' rows, so at most 2 × the grouped
FLOPs when three pairs in four are served. Decode (``P ≪ G``) gets ``b = 1``: each pair its own block,
the gather variant's work; large batches get blocks of 16–128 pairs, whose weights are read once per
block instead of once per pair. A larger ``b`` would gather fewer weights (the larger cost once the
products run in bf16, measured in docs/hpu.md, *MoE*) but breaks the FLOP bound, so the rule stays.

**Precision and dtype.** When ``x`` and every stack share one dtype (bf16 in vLLM) the products run in it:
a bf16 ``bmm`` accumulates in float32 and rounds once, which is exactly the contract's intermediate
"rounded to the weight dtype" and, without routing weight (w13), the delta rounded to it; so neither the
weights nor the inputs are upcast, and the gathers copy half the bytes. With a routing weight (w2) the
expand runs in float32 on upcast B blocks, since the weight multiplies the float32 product before it is
rounded. Mixed dtypes take the float32 (float64) path throughout (:func:`compute_dtype`).

**No host synchronisation**: the counts, orders and positions stay on the device; the only host values
are ``b`` and ``B``, functions of the bucket. Nothing is cached and no float32 copy of the stacks is kept
(the mask and gather variants keep one per adapter set). The sort uses ``argsort`` (int64 indices:
``scatter`` needs them).

**NaN isolation.** A block holds the pairs of one (slot, expert) and padding rows; rows of a ``bmm`` are
independent, so a non-finite weight reaches only the pairs routed to that very (slot, expert) (the mask
variant's dense expand lets a used slot's Inf meet other rows' zeros), and ``index_add_`` adds a block row
only into its own pair's row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rows import RoutedPairs
from .stacks import accumulation_dtype, experts_as_slots, experts_of

CHUNK_BYTES = 16 * 2**20  # gathered weights per chunk of blocks (slice_delta): the peak's weight side, not a tuned value
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
    """The inputs in the block layout ``[B, b, K]`` in ``dtype``: pair ``p`` reads row ``p // pairs_per_row``.

    Empty positions (``pair_at = P``) read the last row (clamped) instead of a zero row: a ``bmm`` row is
    independent of the others and an empty position is never read back, so padding ``x`` with a zero row
    (a copy of all of ``x``) buys nothing. Gathered in the input dtype, then converted: the gathered copy is
    the smaller one when ``dtype`` is wider."""
    rows = torch.div(pair_at, pairs_per_row, rounding_mode="floor").clamp(max=x.size(0) - 1)
    return x.index_select(0, rows).to(dtype).unflatten(0, (-1, block))


def block_row_weights(row_weight: torch.Tensor, pair_at: torch.Tensor) -> torch.Tensor:
    """The routing weight at each block position ``[B·b]`` (0 where empty: the dump position past the pairs)."""
    return F.pad(row_weight, (0, 1)).index_select(0, pair_at)


def stack_index(block_group: torch.Tensor, experts_per_slot: int, stack_experts: int, stack_slots: int) -> torch.Tensor:
    """Each block's matrix in a stack seen as ``[L·E_s, rows, cols]``: ``slot·E_s + expert`` (``slot`` when shared).

    Unused blocks (group ``G``, slot ``L``) read the last matrix: their rows are padding, never read back."""
    slot = torch.div(block_group, experts_per_slot, rounding_mode="floor")
    index = slot * stack_experts + (block_group % experts_per_slot if stack_experts > 1 else 0)
    return index.clamp(max=stack_slots * stack_experts - 1)


def block_weights(stack: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stack[index]`` in ``dtype``: each block's matrix. In the stack's own dtype it is one gather; else
    the cheaper order, fixed per bucket (both sizes are static): with more blocks than matrices, upcast
    every matrix once and gather; else gather, then upcast."""
    if stack.dtype == dtype or index.numel() < stack.size(0):
        return stack.index_select(0, index).to(dtype)
    return stack.to(dtype).index_select(0, index)


def compute_dtype(x: torch.Tensor, *stacks: torch.Tensor) -> torch.dtype:
    """The dtype of the products: the operands' own when ``x`` and every stack share one, else the accumulation dtype.

    A ``bmm`` on bf16 / fp16 operands accumulates in float32 (the CPU's oneDNN and fallback kernels, Gaudi's
    MME) and rounds its result once to the operand dtype: exactly the shrink's intermediate "rounded to the
    weight dtype" and the w13 delta rounded to it, without a float32 copy of any weight. Mixed dtypes (float32
    inputs on bf16 stacks, …) take the upcast path: float32 (float64) operands, as vLLM's kernels accumulate."""
    dtype = x.dtype
    return dtype if all(s.dtype == dtype for s in stacks) else accumulation_dtype(x, *stacks)


def chunk_blocks(blocks: int, rank: int, k: int, n: int, itemsize: int, budget: int = CHUNK_BYTES) -> int:
    """How many blocks one chunk of :func:`slice_delta` holds: its gathered weights (``R·(K + N)`` elements of
    ``itemsize`` bytes per block) within ``budget`` bytes. A function of static shapes only."""
    return max(1, min(blocks, budget // max(1, rank * (k + n) * itemsize)))


def slice_delta(
    x_blocks: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    block_group: torch.Tensor,
    experts_per_slot: int,
    num_slots: int,
    block_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One slice's delta in the block layout ``[B·b, N]``, in the weight dtype: per block
    ``round(w · round(x_b @ A_gᵀ) @ B_gᵀ)``, ``w`` the routing weight at each position (``block_weight``
    ``[B·b]``, w2) or 1.

    ``a_stack`` ``[L·E_a, R, K]`` and ``b_stack`` ``[L·E_b, N, R]`` (``E_a``, ``E_b``: ``E`` or 1 when shared) in
    their own dtype; ``x_blocks`` already in the compute dtype (:func:`compute_dtype`). Rounding as vLLM's
    kernels: float32 accumulation, the intermediate rounded to the weight dtype (``CAST_TYPE``), the routing
    weight applied to the float32 product before the delta is rounded, so a weighted expand runs in the
    accumulation dtype.

    The blocks go in static chunks (:func:`chunk_blocks`): the gathered weights (and a weighted expand's
    float32 copies and products) exist one chunk at a time, never for all ``B`` blocks, and the products
    land in the one ``[B, b, N]`` result. That bounds the peak memory, and on the CPU it is also faster:
    a fresh multi-hundred-MB temporary costs more in page faults than the copy itself (measured: an upcast
    of DeepSeek-V3's gathered B at T = 64 took 3× longer into fresh memory than into reused memory).
    """
    weight_dtype = b_stack.dtype
    compute = x_blocks.dtype
    blocks, block, k = x_blocks.shape
    n, rank = b_stack.size(1), b_stack.size(2)
    expand = compute if compute == weight_dtype and block_weight is None else accumulation_dtype(x_blocks, b_stack)
    a_index = stack_index(block_group, experts_per_slot, a_stack.size(0) // num_slots, num_slots)
    b_index = stack_index(block_group, experts_per_slot, b_stack.size(0) // num_slots, num_slots)
    weights = None if block_weight is None else block_weight.view(blocks, block, 1)
    result = torch.empty(blocks, block, n, dtype=weight_dtype, device=x_blocks.device)
    chunk = chunk_blocks(blocks, rank, k, n, max(compute.itemsize, expand.itemsize))
    for start in range(0, blocks, chunk):  # static: the bounds depend on the bucket's layout only
        part = slice(start, min(start + chunk, blocks))
        a = block_weights(a_stack, a_index[part], compute)  # [c, R, K]: one matrix per block
        shrunk = torch.bmm(x_blocks[part], a.transpose(1, 2)).to(weight_dtype)  # [c, b, R], rounded to the weight dtype
        b = block_weights(b_stack, b_index[part], expand)  # [c, N, R]
        if weights is None and expand == weight_dtype:  # the product rounds once, into the result
            torch.bmm(shrunk, b.transpose(1, 2), out=result[part])
        else:
            product = torch.bmm(shrunk.to(expand), b.transpose(1, 2))  # [c, b, N] in float32
            if weights is not None:
                product.mul_(weights[part].to(expand))
            result[part].copy_(product)  # rounded to the weight dtype
    return result.flatten(0, 1)


class GroupedMoE:
    """The engine's MoE math of this variant: the pure functions above, each in the device layer's form."""

    name = "grouped"

    def __init__(self, prepare, max_block: int = MAX_BLOCK) -> None:
        self.max_block = max_block
        self._plan = prepare(block_plan)
        self._rows = prepare(block_rows)
        self._delta = prepare(slice_delta)
        self._weights = prepare(block_row_weights)

    def deltas(
        self,
        x: torch.Tensor,
        a_stacks: tuple[torch.Tensor, ...],
        b_stacks: tuple[torch.Tensor, ...],
        pairs: RoutedPairs,
        pairs_per_row: int,
        row_weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, Iterator[torch.Tensor]]:
        """The plan and the slices' deltas: ``(pair_at [B·b], position [P_pad], deltas)``.

        ``pair_at``: the pair at each block position (``P_pad`` where empty); ``position``: each pair's block
        position (``B·b`` when not served); ``deltas`` yields each slice's delta in the block layout ``[B·b, N]``
        when asked for it, so the caller writes one slice back (``writeback.merge_blocks``) before the next
        one's delta exists: one ``[B·b, N]`` delta alive at a time. ``x`` is padded (``P_pad / pairs_per_row`` rows),
        ``row_weight`` ``[P_pad]`` (w2) or ``None``."""
        stacks = (*a_stacks, *b_stacks)
        experts = max(experts_of(s) for s in stacks)
        num_slots = a_stacks[0].size(0)
        shape = block_shape(pairs.padded, num_slots * experts, self.max_block)
        pair_at, position, block_group = self._plan(pairs.slots, pairs.experts, pairs.served, experts, shape.groups,
                                                    shape.block, shape.blocks)
        x_blocks = self._rows(x, pair_at, pairs_per_row, shape.block, compute_dtype(x, *stacks))
        weights = None if row_weight is None else self._weights(row_weight, pair_at)
        slices = (
            self._delta(x_blocks, experts_as_slots(a_stack), experts_as_slots(b_stack), block_group, experts, num_slots, weights)
            for a_stack, b_stack in zip(a_stacks, b_stacks, strict=True)
        )
        return pair_at, position, slices
