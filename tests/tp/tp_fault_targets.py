"""Targets that get tensor-parallel LoRA wrong, each in one way, for tests/tp (loaded by name in each rank).

Each is the golden reference (the serving ones: hpu-emulated, which captures) with one method changed; the rank a target runs on is the process
group's rank (``torch.distributed.get_rank()``), so a fault can hit one rank only, as a device
fault on one card would.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.targets.reference import ReferenceTarget


class IgnoresOffsetStart(ReferenceTarget):
    """``add_expand`` writes every slice from column 0, whatever ``offset_start`` says: the fully sharded row
    layer then piles every rank's LoRA-B columns onto rank 0's (a kernel that drops its ``slice_offset``)."""

    name = "ignores-offset-start"

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        super().add_expand(y, x, lora_b_stacked, output_slices, 0, add_inputs, **kwargs)


class ShrinksOnlyRankZero(ReferenceTarget):
    """``add_shrink`` does nothing on ranks other than 0 (a device whose kernel silently skips work): only
    rank 0's part of the LoRA rank (fully sharded column) or of the input features (row) reaches the output."""

    name = "shrinks-only-rank-zero"

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        if dist.get_rank() == 0:
            super().add_shrink(y, x, lora_a_stacked, scale, **kwargs)


class Rank1DeltaTwoPercentHigh(ReferenceTarget):
    """On rank 1, ``add_lora_linear`` adds its LoRA delta 2 % too large (a device that mis-scales one card's
    epilogue): small enough to stay inside the elementwise budget, along the delta everywhere rank 1 writes."""

    name = "rank1-delta-two-percent-high"

    def add_lora_linear(self, y, *args, **kwargs):
        before = y.clone()
        super().add_lora_linear(y, *args, **kwargs)
        if dist.get_rank() == 1:
            y.copy_(before + (y.double() - before.double()) * 1.02)


class Rank1ExpandClearsItsBuffer(ReferenceTarget):
    """On rank 1, ``add_expand`` zeroes the shrink buffer it reads after using it (scratch reuse in a
    kernel): the layer's output is right, but an input every wrapper method must only read was written."""

    name = "rank1-expand-clears-its-buffer"

    def add_expand(self, y, x, *args, **kwargs):
        super().add_expand(y, x, *args, **kwargs)
        if dist.get_rank() == 1:
            x.zero_()


class Rank1HangsOnce(ReferenceTarget):
    """Rank 1 blocks in its first ``add_lora_linear`` of the run (a device call that never returns)."""

    name = "rank1-hangs-once"

    def add_lora_linear(self, *args, **kwargs):
        marker = os.environ.get("TP_TEST_MARKER")
        if dist.get_rank() == 1 and marker and not os.path.exists(marker):  # only the first pool hangs
            open(marker, "w").close()
            time.sleep(3600)
        super().add_lora_linear(*args, **kwargs)


class Rank1DiesOnce(ReferenceTarget):
    """Rank 1 exits from native code in its first ``add_lora_linear`` of the run (a driver abort)."""

    name = "rank1-dies-once"

    def add_lora_linear(self, *args, **kwargs):
        marker = os.environ.get("TP_TEST_MARKER")
        if dist.get_rank() == 1 and marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        super().add_lora_linear(*args, **kwargs)


class EveryRankRaisesInLinear(ReferenceTarget):
    """``add_lora_linear`` raises on every rank, before any collective (a port whose fused path the device lacks):
    every rank answers the case, so the pool serves the next one (``add_shrink``/``add_expand`` still work)."""

    name = "every-rank-raises-in-linear"

    def add_lora_linear(self, *args, **kwargs):
        raise RuntimeError(f"no fused LoRA kernel on rank {dist.get_rank()}")


class Rank1RaisesInLinear(ReferenceTarget):
    """``add_lora_linear`` raises on rank 1 only: rank 0 goes on into the collective and waits there for rank 1."""

    name = "rank1-raises-in-linear"

    def add_lora_linear(self, *args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("no fused LoRA kernel on rank 1")
        super().add_lora_linear(*args, **kwargs)


class NoExpand(ReferenceTarget):
    """A target without ``add_expand``: its TP cases are not supported, naming the method."""

    name = "no-expand"
    add_expand = None


# -- the MoE LoRA layer (conformance/tp/moe_layer.py) ------------------------------------------------


class SwapsW13Halves(ReferenceTarget):
    """``add_lora_w13`` takes the gate and up slices in the other order (a port that reads vLLM's
    ``swap_w13_slices`` the wrong way round): gate's columns get up's delta and up's get gate's."""

    name = "swaps-w13-halves"

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, *args, **kwargs):
        super().add_lora_w13(y, x, tuple(lora_a_stacked)[::-1], tuple(lora_b_stacked)[::-1], *args, **kwargs)


class PacksW13SlicesByLiveRows(ReferenceTarget):
    """``add_lora_w13`` drops each LoRA-B slice's trailing all-zero rows and writes the slices back to back:
    on a rank whose intermediate size is padded, up lands at the unpadded offset ``I / tp`` instead of the
    padded one, where the base w13 weight has it (vLLM 0.32's slicing put it there too). Unpadded, the
    slices have no zero rows and it is correct."""

    name = "packs-w13-slices-by-live-rows"

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, *args, **kwargs):
        live = [int(b.abs().amax(dim=(0, 1, 3)).nonzero().max()) + 1 for b in lora_b_stacked]
        trimmed = tuple(b[:, :, :rows, :] for b, rows in zip(lora_b_stacked, live))
        packed = y[..., : sum(live)].contiguous()
        super().add_lora_w13(packed, x, lora_a_stacked, trimmed, *args, **kwargs)
        y[..., : sum(live)] = packed


class ReducesW2Itself(ReferenceTarget):
    """``add_lora_w2`` all-reduces its delta over the ranks before adding it (as vLLM's fused kernel does
    between shrink and expand when fully sharded): the layer then reduces again, so the delta counts
    ``tp`` times."""

    name = "reduces-w2-itself"

    def add_lora_w2(self, y, *args, **kwargs):
        before = y.clone()
        super().add_lora_w2(y, *args, **kwargs)
        delta = y - before
        dist.all_reduce(delta)
        y.copy_(before + delta)


class NoMoE(ReferenceTarget):
    """A target without the MoE wrapper methods: its MoE TP cases are not supported, the linear ones run."""

    name = "no-moe"
    add_lora_w13 = None
    add_lora_w2 = None


class ZeroesNoAdapterRows(ReferenceTarget):
    """``add_lora_linear`` zeroes the rows of slot −1 on every rank (a kernel that stores a zero delta there
    instead of leaving the row): after the gather those rows are zero where the base output must stand."""

    name = "zeroes-no-adapter-rows"

    def add_lora_linear(self, y, *args, **kwargs):
        super().add_lora_linear(y, *args, **kwargs)
        y[self.mapping.token_slot_tensor().to(y.device) == -1] = 0


class CannotDraw(ReferenceTarget):
    """The reference, made in a rank that can no longer draw values: ``torch.Generator`` and the suite's drawing
    functions (``conformance.tp.values.layer_tensors``, ``conformance.tp.moe_layer.moe_tensors`` and the names
    ``conformance.tp.composition`` holds of them) raise. A rank must be handed its tensors by the referee: one
    that drew them in the target's process would raise here."""

    name = "cannot-draw"

    def __init__(self):
        super().__init__()
        import torch

        from conformance.tp import composition, moe_layer, values

        def forbidden(*args, **kwargs):
            raise RuntimeError("a tensor-parallel rank drew values in the target's process")

        torch.Generator = forbidden
        values.layer_tensors = moe_layer.moe_tensors = composition.layer_tensors = composition.moe_tensors = forbidden


# -- serving: graph-safe on one rank, wrong between steps on another (tests/tp/test_tp_serving.py) ---------------


class Rank1ForgetsItServes(HpuEmulatedTarget):
    """Served, rank 1 drops the persistent slot vectors ``start_serving`` made, so each ``update_metadata`` writes
    its batch into new tensors: a graph captured on rank 1 replays the mapping of the batch it was captured
    with (the other ranks, and the same batch called fresh, are right)."""

    name = "rank1-forgets-it-serves"

    def start_serving(self, capacity) -> None:
        super().start_serving(capacity)
        if dist.get_rank() == 1:
            self.serving = {}


class Rank1ClearsItsLastActivationRow(HpuEmulatedTarget):
    """On rank 1, ``add_lora_linear`` zeroes the last row of the activations it was handed after using them (a
    kernel that uses its input as scratch): the output is right, a persistent input is not."""

    name = "rank1-clears-its-last-activation-row"

    def add_lora_linear(self, y, x, *args, **kwargs):
        super().add_lora_linear(y, x, *args, **kwargs)
        if dist.get_rank() == 1:
            x[-1:].zero_()


class Rank1WritesOneRowPast(HpuEmulatedTarget):
    """On rank 1, ``add_lora_linear`` also writes the output row just past the rows it was handed, where the storage
    has one (a grid one block too long): a buffer of exactly the batch's rows shows nothing, a persistent one does."""

    name = "rank1-writes-one-row-past"

    def add_lora_linear(self, y, *args, **kwargs):
        super().add_lora_linear(y, *args, **kwargs)
        if dist.get_rank() != 1 or y.dim() != 2:
            return
        offset = y.storage_offset() + y.size(0) * y.stride(0)
        if (offset + y.size(1)) * y.element_size() <= y.untyped_storage().nbytes():
            y.as_strided((1, y.size(1)), y.stride(), offset).fill_(7.0)
