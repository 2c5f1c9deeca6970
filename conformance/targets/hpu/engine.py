"""The engine: one LoRA step (shrink, expand, or both fused) from caller tensors into caller tensors.

It is the layer between vLLM's calling conventions (``wrapper``, ``kernels``) and the pure math
(``mask_math`` or ``gather_math``, plus ``writeback``). Per call it

1. pads the inputs' rows up to the bucket of the row state (:class:`rows.PaddedRows`), so the math
   only ever sees bucket-sized tensors (``pad_rows`` always yields a fresh contiguous tensor, so
   strides do not vary with the row count either);
2. fetches the prepared weight forms from the cache (:class:`stacks.PreparedStacks`);
3. runs the core functions, in the form the device layer prepared them (eager, lazy, HPU graph or
   ``torch.compile``);
4. copies the valid rows of the result into the caller's output view.

Which math runs is the *variant*: ``"mask"`` (Gaudi's mask-based BGMV, the default) or ``"gather"``
(the earlier per-row ``index_select``). Both expose the same four operations below, so everything
else is shared and the two can be compared case by case. The fused-MoE LoRA has a *MoE variant* of
its own: ``"grouped"`` (``grouped_moe``: pairs sorted by (slot, expert) into blocks, one weight gather
per block), or the mask or gather math over virtual slots ``slot·E + expert``; by default the dense
variant's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import gather_math, mask_math, writeback
from .buckets import BucketPolicy
from .device import CpuDeviceLayer, DeviceLayer
from .grouped_moe import GroupedMoE
from .rows import PaddedRows, RoutedPairs
from .stacks import PreparedStacks, as_3d, bias_table, experts_of, flat_a, flat_b, moe_flat_a, moe_flat_b, moe_upcast_3d, upcast_3d


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows; always a fresh contiguous tensor or ``t`` itself if contiguous."""
    if t.size(0) == rows:
        return t.contiguous()
    return F.pad(t, (0, 0, 0, rows - t.size(0)))


class MaskVariant:
    """Gaudi's mask-based math over flattened stacks (``mask_math``)."""

    name = "mask"

    def __init__(self, stacks: PreparedStacks, prepare: Callable[[Callable], Callable]) -> None:
        self.stacks = stacks
        self._shrink = prepare(mask_math.shrink_rows)
        self._expand = prepare(mask_math.expand_rows)
        self._linear = prepare(mask_math.linear)
        self._table_rows = prepare(mask_math.select_table_rows)

    def shrink(self, x: torch.Tensor, a_stack: torch.Tensor, rows: PaddedRows, scale: float) -> torch.Tensor:
        slots, rank, _ = as_3d(a_stack).shape
        return self._shrink(x, self.stacks.get(a_stack, flat_a), rows.mask(slots, rank), scale, rank)

    def expand(self, s: torch.Tensor, b_stack: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
        b = as_3d(b_stack)
        return self._expand(s, self.stacks.get(b_stack, flat_b), rows.mask(b.size(0), b.size(2)), b.dtype)

    def linear(self, x, a_stack, b_stack, rows: PaddedRows, scale: float) -> torch.Tensor:
        b = as_3d(b_stack)
        a_flat, b_flat = self.stacks.get(a_stack, flat_a), self.stacks.get(b_stack, flat_b)
        return self._linear(x, a_flat, b_flat, rows.mask(b.size(0), b.size(2)), scale, b.dtype)

    def table_rows(self, table_stack: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
        return self._table_rows(self.stacks.get(table_stack, bias_table), rows.onehot(table_stack.size(0)))

    def moe_shrink(self, x, a_stack, rows: PaddedRows) -> torch.Tensor:
        virtual_slots, rank = a_stack.size(0) * experts_of(a_stack), a_stack.size(2)
        return self._shrink(x, self.stacks.get(a_stack, moe_flat_a), rows.mask(virtual_slots, rank), 1.0, rank)

    def moe_expand(self, s, b_stack, rows: PaddedRows, row_weight) -> torch.Tensor:
        virtual_slots, rank = b_stack.size(0) * experts_of(b_stack), b_stack.size(3)
        return self._expand(s, self.stacks.get(b_stack, moe_flat_b), rows.mask(virtual_slots, rank), b_stack.dtype, row_weight)


class GatherVariant:
    """The earlier gather-based math over 3-D stacks (``gather_math``)."""

    name = "gather"

    def __init__(self, stacks: PreparedStacks, prepare: Callable[[Callable], Callable]) -> None:
        self.stacks = stacks
        self._shrink = prepare(gather_math.shrink_rows)
        self._expand = prepare(gather_math.expand_rows)
        self._linear = prepare(gather_math.linear)
        self._table_rows = prepare(gather_math.select_table_rows)

    def shrink(self, x, a_stack, rows: PaddedRows, scale: float) -> torch.Tensor:
        return self._shrink(x, self.stacks.get(a_stack, upcast_3d), rows.gather_index, rows.row_active, scale)

    def expand(self, s, b_stack, rows: PaddedRows) -> torch.Tensor:
        b3 = self.stacks.get(b_stack, upcast_3d)
        return self._expand(s, b3, rows.gather_index, rows.row_active, b_stack.dtype)

    def linear(self, x, a_stack, b_stack, rows: PaddedRows, scale: float) -> torch.Tensor:
        a3, b3 = self.stacks.get(a_stack, upcast_3d), self.stacks.get(b_stack, upcast_3d)
        return self._linear(x, a3, b3, rows.gather_index, rows.row_active, scale, b_stack.dtype)

    def table_rows(self, table_stack: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
        return self._table_rows(self.stacks.get(table_stack, bias_table), rows.gather_index, rows.row_active)

    def moe_shrink(self, x, a_stack, rows: PaddedRows) -> torch.Tensor:
        return self._shrink(x, self.stacks.get(a_stack, moe_upcast_3d), rows.gather_index, rows.row_active, 1.0)

    def moe_expand(self, s, b_stack, rows: PaddedRows, row_weight) -> torch.Tensor:
        return self._expand(s, self.stacks.get(b_stack, moe_upcast_3d), rows.gather_index, rows.row_active, b_stack.dtype, row_weight)


VARIANTS = {"mask": MaskVariant, "gather": GatherVariant}
MOE_VARIANTS = ("grouped", *VARIANTS)


class LoRAEngine:
    """Shrink / expand / fused LoRA steps into caller tensors, with bucketing, caching and device hooks."""

    def __init__(
        self, variant: str = "mask", buckets: BucketPolicy | None = None, layer: DeviceLayer | None = None,
        moe_variant: str | None = None,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown HPU LoRA variant {variant!r}; known: {', '.join(VARIANTS)}")
        moe_variant = moe_variant or variant
        if moe_variant not in MOE_VARIANTS:
            raise ValueError(f"unknown HPU MoE LoRA variant {moe_variant!r}; known: {', '.join(MOE_VARIANTS)}")
        self.layer = layer if layer is not None else CpuDeviceLayer()
        self.buckets = buckets if buckets is not None else BucketPolicy()
        self.stacks = PreparedStacks()
        self.variant = VARIANTS[variant](self.stacks, self.layer.prepare)
        if moe_variant == "grouped":
            self.moe_variant = GroupedMoE(self.layer.prepare)
        else:
            self.moe_variant = self.variant if moe_variant == variant else VARIANTS[moe_variant](self.stacks, self.layer.prepare)
        self._merge = self.layer.prepare(writeback.merge)
        self._merge_blocks = self.layer.prepare(writeback.merge_blocks)
        self._add_bias = self.layer.prepare(writeback.add_bias)
        self._accumulate = self.layer.prepare(writeback.accumulate)
        self._replace = self.layer.prepare(writeback.replace)

    @property
    def device(self) -> torch.device:
        return self.layer.device

    def rows(self, slots: torch.Tensor) -> PaddedRows:
        """The row state for one slot per row (any device): padded to its bucket, on this device."""
        return PaddedRows.from_slots(slots, self.buckets, self.device)

    # -- the three steps ---------------------------------------------------------------------

    def shrink_into(self, out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, rows: PaddedRows, scale: float) -> None:
        """``out[t, :R] += scale · x[t] @ A_lᵀ`` for rows with an adapter; ``out`` is ``[T, ≥R]``."""
        slots, rank, hidden = as_3d(a_stack).shape
        _check_rows(rows, x=x, out=out)
        if x.size(-1) != hidden:
            raise ValueError(f"inputs have {x.size(-1)} features but LoRA-A expects {hidden}")
        if out.size(-1) < rank:
            raise ValueError(f"the output has {out.size(-1)} columns, fewer than the rank {rank}")
        shrunk = self.variant.shrink(pad_rows(x, rows.padded), a_stack, rows, scale)
        target = out[:, :rank]
        self._write(target, self._accumulate(pad_rows(target, rows.padded), shrunk, rows.row_active), rows)

    def expand_into(
        self,
        out: torch.Tensor,
        s: torch.Tensor,
        b_stack: torch.Tensor,
        rows: PaddedRows,
        column: int,
        add_inputs: bool,
        bias: torch.Tensor | None = None,
    ) -> None:
        """``out[t, column:column+N] = (out if add_inputs else 0) + s[t] @ B_lᵀ (+ bias_l)`` for rows with an adapter."""
        _, width, rank = as_3d(b_stack).shape
        _check_rows(rows, x=s, out=out)
        if s.size(-1) != rank:
            raise ValueError(f"inputs have rank {s.size(-1)} but LoRA-B has rank {rank}")
        target = _columns(out, column, width)
        delta = self.variant.expand(pad_rows(s, rows.padded), b_stack, rows)
        self._finish(target, delta, rows, add_inputs, bias)

    def linear_into(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        rows: PaddedRows,
        column: int,
        scale: float,
        bias: torch.Tensor | None = None,
        add_inputs: bool = True,
    ) -> None:
        """``out[t, column:column+N] = (out if add_inputs else 0) + scale · (x[t] @ A_lᵀ) @ B_lᵀ (+ bias_l)`` for rows with an adapter."""
        a, b = as_3d(a_stack), as_3d(b_stack)
        _check_rows(rows, x=x, out=out)
        if (a.size(0), a.size(1)) != (b.size(0), b.size(2)):
            raise ValueError(f"LoRA-A {tuple(a.shape)} and LoRA-B {tuple(b.shape)} disagree on slots or rank")
        if x.size(-1) != a.size(2):
            raise ValueError(f"inputs have {x.size(-1)} features but LoRA-A expects {a.size(2)}")
        target = _columns(out, column, b.size(1))
        delta = self.variant.linear(pad_rows(x, rows.padded), a_stack, b_stack, rows, scale)
        self._finish(target, delta, rows, add_inputs, bias)

    def full_linear_into(
        self, out: torch.Tensor, x: torch.Tensor, weight_stack: torch.Tensor, bias: torch.Tensor | None, rows: PaddedRows
    ) -> None:
        """``out[t] = x[t] @ W_lᵀ (+ bias_l)`` for rows with an adapter, replacing the row; others untouched.

        A full linear layer per slot is a shrink whose "rank" is the output width: the variant's shrink
        computes it in float32 (the mask's ``[T, L·P]`` block or the gather), the bias rows come as
        LoRA bias does, and ``writeback.replace`` rounds once and keeps the other rows bit for bit.
        """
        _, width, hidden = as_3d(weight_stack).shape
        _check_rows(rows, x=x, out=out)
        if x.size(-1) != hidden:
            raise ValueError(f"inputs have {x.size(-1)} features but the weights expect {hidden}")
        if out.size(-1) != width:
            raise ValueError(f"the output has {out.size(-1)} columns, the weights {width} rows")
        if bias is not None and bias[0].numel() != width:
            raise ValueError(f"the bias {tuple(bias.shape)} does not match an output of width {width}")
        product = self.variant.shrink(pad_rows(x, rows.padded), weight_stack, rows, 1.0)
        bias_rows = None if bias is None else self.variant.table_rows(bias, rows)
        self._write(out, self._replace(pad_rows(out, rows.padded), product, bias_rows, rows.row_active), rows)

    def moe_into(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        a_stacks: tuple[torch.Tensor, ...],
        b_stacks: tuple[torch.Tensor, ...],
        pairs: RoutedPairs,
        top_k: int,
        offset: int,
        add_inputs: bool,
        routing_weights: torch.Tensor | None = None,
    ) -> None:
        """The fused-MoE LoRA into ``out`` ``[T·top_k, W]``, slice ``s`` at ``offset + s·N``.

        ``x`` is ``[T, K]`` (w13: each pair reads its token's row) or, with ``routing_weights`` ``[T·top_k]``
        (w2), ``[T·top_k, K]``. Per slice: the shrink over the virtual slots of its LoRA-A, the intermediate
        rounded to the weight dtype, the (weighted) expand over those of its LoRA-B, the pairs that are not
        served left bit-identical.
        """
        if len(a_stacks) != len(b_stacks) or not a_stacks:
            raise ValueError(f"{len(a_stacks)} LoRA-A stacks but {len(b_stacks)} LoRA-B stacks")
        width = b_stacks[0].size(2)
        _check_rows(pairs.rows(1), out=out)
        for a_stack, b_stack in zip(a_stacks, b_stacks, strict=True):
            if b_stack.size(2) != width:
                raise ValueError(f"MoE slices have equal widths, got {[b.size(2) for b in b_stacks]}")
            if x.size(-1) != a_stack.size(3):
                raise ValueError(f"inputs have {x.size(-1)} features but LoRA-A expects {a_stack.size(3)}")
        pairs_per_row = top_k if routing_weights is None else 1
        weight = None if routing_weights is None else pad_rows(routing_weights.reshape(-1, 1), pairs.padded).reshape(-1)
        if isinstance(self.moe_variant, GroupedMoE):  # every slice from one block plan; x read in place, not per pair
            if pairs.padded == 0:
                return
            x_rows = pad_rows(x, pairs.padded // pairs_per_row)
            pair_at, position, deltas = self.moe_variant.deltas(x_rows, a_stacks, b_stacks, pairs, pairs_per_row, weight)
            for s, delta in enumerate(deltas):
                target = _columns(out, offset + s * width, width)  # only the slice's columns are read and written
                # the padded rows plus the dump row that empty block positions write (writeback.merge_blocks)
                scratch = pad_rows(target, pairs.padded + 1)
                self._write(target, self._merge_blocks(scratch, delta, pair_at, position, pairs.served, add_inputs), pairs.rows(1))
            return
        x_pairs = pad_rows(x, pairs.padded // pairs_per_row)
        if pairs_per_row > 1:  # w13: each pair reads its token's row
            x_pairs = x_pairs.repeat_interleave(pairs_per_row, 0)
        for s, (a_stack, b_stack) in enumerate(zip(a_stacks, b_stacks, strict=True)):
            rows_b = pairs.rows(experts_of(b_stack))
            shrunk = self.moe_variant.moe_shrink(x_pairs, a_stack, pairs.rows(experts_of(a_stack)))
            delta = self.moe_variant.moe_expand(shrunk, b_stack, rows_b, weight)
            self._finish(_columns(out, offset + s * width, width), delta, rows_b, add_inputs, None)

    # -- helpers -----------------------------------------------------------------------------

    def _finish(self, target, delta, rows: PaddedRows, add_inputs: bool, bias: torch.Tensor | None) -> None:
        result = self._merge(pad_rows(target, rows.padded), delta, rows.row_active, add_inputs)
        if bias is not None:
            if bias[0].numel() != target.size(1):
                raise ValueError(f"LoRA bias {tuple(bias.shape)} does not match a slice of width {target.size(1)}")
            result = self._add_bias(result, self.variant.table_rows(bias, rows), rows.row_active)
        self._write(target, result, rows)

    def _write(self, target: torch.Tensor, result: torch.Tensor, rows: PaddedRows) -> None:
        self.layer.check_placement(result)
        target.copy_(result[: rows.count])


def _check_rows(rows: PaddedRows, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.size(0) != rows.count:
            raise ValueError(f"the mapping describes {rows.count} rows, the {name} tensor has {tensor.size(0)}")


def _columns(out: torch.Tensor, column: int, width: int) -> torch.Tensor:
    if column < 0 or column + width > out.size(-1):
        raise ValueError(f"slice [{column}, {column + width}) does not fit an output of width {out.size(-1)}")
    return out[:, column : column + width]
