"""A plain, correct torch target of the kernel ops, and seeded faults: real LoRA bug classes, one each.

``PlainTorchTarget`` is written independently of ``conformance.reference``: where the reference
groups rows by adapter, this one works like Gaudi's mask-based LoRA ops (docs/gaudi-lora.md §1.2). Every
row's product is taken against *all* slots at once, then a ``[T, L·R]`` one-hot mask keeps the
columns of the row's own slot:

    shrink:  out[t] += scale · Σ_l mask[t, l] · (x[t] @ A[l]ᵀ)          A flattened to [L·R, H]
    expand:  delta[t] = (mask[t] ⊙ tile(x[t], L)) @ B_flat               B flattened to [L·R, N]

Rounding follows vLLM's Triton kernels: products accumulate in float32; a float32 expand input is
rounded to the weight dtype first (``CAST_TYPE``); the expand delta is rounded to the weight dtype
before it is added to the output. Rows of slot −1 are never written, nor are columns outside the
slice. The wrapper methods come from :class:`KernelTarget` (the ``lora_*`` composition).

Each fault below is a subclass changing one method, with a docstring naming the real bug it models.
``FAULTS`` lists those the smoke profile must catch; ``UNCAUGHT_BY_DESIGN`` those it cannot, and why.
"""

from __future__ import annotations

import torch

from conformance.reference import LoRAKernelMeta
from conformance.targets.kernel_target import KernelTarget


def as_3d(stack: torch.Tensor) -> torch.Tensor:
    """A LoRA stack as ``[L, rows, cols]`` (vLLM layers pass ``[L, 1, rows, cols]``)."""
    return stack[:, 0] if stack.ndim == 4 else stack


class PlainTorchTarget(KernelTarget):
    name = "plain-torch"
    description = "a deliberately plain mask-based torch implementation of the kernel ops (tests only)"

    # -- slots per row, from each kind of metadata ---------------------------------------------

    def slots_of_segments(self, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, rows: int) -> torch.Tensor:
        """sgmv: segment ``b`` covers ``[start_b, start_b + len_b)``; rows outside every segment get −1."""
        slots = torch.full((rows,), -1, dtype=torch.long, device=seq_len_tensor.device)
        for start, length, slot in zip(b_seq_start_loc.tolist(), seq_len_tensor.tolist(), lora_indices_tensor.tolist()):
            slots[start : start + length] = slot
        return slots

    def slots_of_kernel_meta(self, sorted_rows, counts, starts, lora_ids, rows: int) -> torch.Tensor:
        """lora_*: the rows of active id ``i`` are ``sorted_rows[starts[i] : starts[i] + counts[i]]``."""
        slots = torch.full((rows,), -1, dtype=torch.long, device=sorted_rows.device)
        for slot, start, count in zip(lora_ids.tolist(), starts.tolist(), counts.tolist()):
            if slot != -1 and count > 0:
                slots[sorted_rows[start : start + count].long()] = slot
        return slots

    def resolve_slots(self, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
        """The slot whose weights each row reads (−1: none)."""
        return slots

    # -- the mask and the products -------------------------------------------------------------

    def slot_mask(self, slots: torch.Tensor, num_slots: int, rank: int) -> torch.Tensor:
        """float32 ``[T, L·R]``: ones in columns ``[l·R, (l+1)·R)`` of a row with slot ``l``, zeros for −1."""
        one_hot = torch.zeros(slots.numel(), num_slots, dtype=torch.float32, device=slots.device)
        used = slots != -1
        one_hot[used, slots[used]] = 1.0
        return one_hot.repeat_interleave(rank, dim=1)

    def accumulate(self, inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``inputs[T, K] @ weights[M, K]ᵀ`` summed in float32."""
        return inputs.float() @ weights.float().T

    def shrink_product(self, x: torch.Tensor, flat_a: torch.Tensor) -> torch.Tensor:
        return self.accumulate(x, flat_a)

    def expand_product(self, tiled: torch.Tensor, flat_b: torch.Tensor) -> torch.Tensor:
        return self.accumulate(tiled, flat_b)

    def apply_scale(self, product: torch.Tensor, scale: float) -> torch.Tensor:
        return scale * product

    def store_shrink(self, product: torch.Tensor, out_dtype: torch.dtype, in_dtype: torch.dtype) -> torch.Tensor:
        """What the shrink adds to its output: the float32 product in the output dtype."""
        return product.to(out_dtype)

    def cast_expand_input(self, x: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
        """``CAST_TYPE``: a float32 expand input is rounded to the weight dtype before the product."""
        return x.to(weight_dtype) if x.dtype == torch.float32 else x

    def rank_columns(self, rank: int) -> int:
        """How many rank columns the expand reads."""
        return rank

    def expanded_width(self, lora_b: torch.Tensor) -> int:
        """How many output columns the expand writes from its slice offset."""
        return lora_b.size(1)

    def slice_offsets(self, widths: list[int], offset_start: int) -> list[int]:
        """First output column of each slice: ``offset_start + Σ_{j<s} N_j``."""
        offsets, column = [], offset_start
        for width in widths:
            offsets.append(column)
            column += width
        return offsets

    def rows_written(self, slots: torch.Tensor, add_inputs: bool) -> torch.Tensor:
        """The rows an expand writes: those with an adapter."""
        return slots != -1

    def shrink_rows(self, x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
        """``out[t, :R] += scale · x[t] @ A[slot_t]ᵀ`` for rows with an adapter (``lora_a``: ``[L, R, H]``)."""
        num_slots, rank, hidden = lora_a.shape
        slots = self.resolve_slots(slots, num_slots)
        every_slot = self.shrink_product(x, lora_a.reshape(num_slots * rank, hidden))  # [T, L·R]
        mine = (every_slot * self.slot_mask(slots, num_slots, rank)).view(-1, num_slots, rank).sum(dim=1)
        rows = slots != -1
        added = self.store_shrink(self.apply_scale(mine[rows], scale), out.dtype, x.dtype)
        out[rows, :rank] += added

    def expand_rows(self, x, lora_b: torch.Tensor, out, slots, offset: int, add_inputs: bool) -> None:
        """``out[t, off:off+N] = (out if add_inputs else 0) + round(x[t] @ B[slot_t]ᵀ)`` (``lora_b``: ``[L, N, R]``)."""
        num_slots, _, rank = lora_b.shape
        if x.size(-1) != rank:
            raise ValueError(f"expand input has rank {x.size(-1)}, LoRA-B has rank {rank}")
        slots = self.resolve_slots(slots, num_slots)
        used_rank = self.rank_columns(rank)
        weights = self.padded_weights(lora_b, self.expanded_width(lora_b))[:, :, :used_rank]  # [L, W', R']
        x = self.cast_expand_input(x, lora_b.dtype)[:, :used_rank]
        tiled = x.float().repeat(1, num_slots) * self.slot_mask(slots, num_slots, used_rank)  # [T, L·R']
        flat = weights.permute(1, 0, 2).reshape(weights.size(1), num_slots * used_rank)  # [W', L·R']
        delta = self.expand_product(tiled, flat).to(lora_b.dtype)
        self.write_expand(out, delta, self.rows_written(slots, add_inputs), offset, add_inputs)

    def padded_weights(self, lora_b: torch.Tensor, width: int) -> torch.Tensor:
        """``lora_b`` with ``width`` output rows; rows past ``N`` read the stack's memory that follows."""
        if width == lora_b.size(1):
            return lora_b
        num_slots, n, rank = lora_b.shape
        flat = torch.cat([lora_b.reshape(num_slots * n, rank), lora_b.new_zeros(width, rank)])
        index = torch.arange(num_slots)[:, None] * n + torch.arange(width)[None, :]
        return flat[index.to(lora_b.device)]

    def write_expand(self, out, delta, rows, offset: int, add_inputs: bool) -> None:
        columns = slice(offset, min(offset + delta.size(1), out.size(1)))
        delta = delta[rows, : columns.stop - columns.start].float()
        if add_inputs:
            delta = delta + out[rows, columns].float()
        out[rows, columns] = delta.to(out.dtype)

    # -- the six classic ops ---------------------------------------------------------------------

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        self.shrink_rows(inputs, as_3d(lora_a_weights), output_tensor, lora_indices_tensor.long(), scaling)

    def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        self.expand_rows(inputs, as_3d(lora_b_weights), output_tensor, lora_indices_tensor.long(), 0, add_inputs)

    def bgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True):
        lora_b = _checked_slice(as_3d(lora_b_weights), slice_size)
        self.expand_rows(inputs, lora_b, output_tensor, lora_indices_tensor.long(), slice_offset, add_inputs)

    def sgmv_shrink(self, inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, scaling):
        _check_token_nums(inputs, token_nums)
        slots = self.slots_of_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
        self.shrink_rows(inputs, as_3d(lora_a_weights), output_tensor, slots, scaling)

    def sgmv_expand(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, add_inputs=False):
        _check_token_nums(inputs, token_nums)
        slots = self.slots_of_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
        self.expand_rows(inputs, as_3d(lora_b_weights), output_tensor, slots, 0, add_inputs)

    def sgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                          batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
        _check_token_nums(inputs, token_nums)
        slots = self.slots_of_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
        self.expand_rows(inputs, _checked_slice(as_3d(lora_b_weights), slice_size), output_tensor, slots, slice_offset, add_inputs)

    # -- lora_shrink / lora_expand -----------------------------------------------------------------

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling):
        if bool(no_lora_flag_cpu.item()):
            return
        slots = self.slots_of_kernel_meta(token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                                          lora_ids, inputs.size(0))
        for s, lora_a in enumerate(self.shrink_stacks(lora_a_weights)):
            self.shrink_rows(inputs, lora_a, output_tensor[s], slots, scaling)

    def shrink_stacks(self, lora_a_weights) -> list[torch.Tensor]:
        """The LoRA-A stack each slice reads."""
        return [as_3d(a) for a in lora_a_weights]

    def lora_expand(self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, offset_start=0, add_inputs=False):
        if bool(no_lora_flag_cpu.item()):
            return
        slots = self.slots_of_kernel_meta(token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                                          lora_ids, inputs.size(1))
        stacks = [as_3d(b) for b in lora_b_weights]
        offsets = self.slice_offsets([b.size(1) for b in stacks], offset_start)
        for s, (lora_b, offset) in enumerate(zip(stacks, offsets)):
            self.expand_rows(inputs[s], lora_b, output_tensor, slots, offset, add_inputs)


class PlainTorchClassicTarget(PlainTorchTarget):
    """The same kernels with the wrapper methods composed like vLLM's CPU wrapper (sgmv / bgmv ops)."""

    name = "plain-torch-classic"
    wrapper_paths = ("classic",)


def _checked_slice(lora_b: torch.Tensor, slice_size: int) -> torch.Tensor:
    if slice_size != lora_b.size(1):
        raise ValueError(f"slice_size {slice_size} differs from the LoRA-B width {lora_b.size(1)}")
    return lora_b


def _check_token_nums(inputs: torch.Tensor, token_nums: int) -> None:
    if inputs.size(0) != token_nums:
        raise ValueError(f"token_nums {token_nums} but the input has {inputs.size(0)} rows")


# =============================================================================================
# Seeded faults: one idea each.
# =============================================================================================


class NegativeIndexIsLastSlot(PlainTorchTarget):
    """Slot −1 gathers the last slot's weights by negative indexing and the row is written.

    vLLM's CPU torch ops index ``lora_weights[lora_indices]`` (vllm#48421): requests without LoRA get
    the last adapter's delta."""

    name = "fault-neg1-is-last-slot"

    def resolve_slots(self, slots, num_slots):
        return torch.where(slots == -1, num_slots - 1, slots)


class SlotIdUsedAsSlot(PlainTorchTarget):
    """Slots read the previous slot's weights: a 1-based adapter id converted to a slot twice.

    The id ↔ slot translation (``lora_index_to_id``, id = slot + 1) applied one time too many; slot 0
    then reads slot −1, i.e. the last slot by negative indexing."""

    name = "fault-slot-off-by-one"

    def resolve_slots(self, slots, num_slots):
        return torch.where(slots == -1, slots, (slots - 1) % num_slots)


class MaskBlockOffByOne(PlainTorchTarget):
    """The mask's column block of slot ``l`` starts at ``l·R + 1`` instead of ``l·R``.

    Gaudi's LoRA runs on a ``[T, L·R]`` mask built by the model runner (docs/gaudi-lora.md §3.1); an off-by-one
    in the block start mixes one rank column of the neighbouring slot in and drops one of its own."""

    name = "fault-mask-block-off-by-one"

    def slot_mask(self, slots, num_slots, rank):
        mask = super().slot_mask(slots, num_slots, rank)
        shifted = torch.zeros_like(mask)
        shifted[:, 1:] = mask[:, :-1]
        return shifted


class LastSlotNeverApplied(PlainTorchTarget):
    """Rows of the last slot ``L−1`` get no delta: the slot loop runs to ``L−2``.

    vLLM's own tests draw slots in ``[0, L−2]`` only (docs/vllm-lora-ops.md §7.1), so an off-by-one loop bound over
    the slots passes them."""

    name = "fault-last-slot-never-applied"

    def slot_mask(self, slots, num_slots, rank):
        mask = super().slot_mask(slots, num_slots, rank)
        mask[:, (num_slots - 1) * rank :] = 0
        return mask


class ScaleAppliedTwice(PlainTorchTarget):
    """The shrink multiplies by ``scale`` twice (once in the kernel, once more in the epilogue)."""

    name = "fault-scale-twice"

    def apply_scale(self, product, scale):
        return scale * (scale * product)


class ScalesInputInPlace(PlainTorchTarget):
    """The shrink scales its input activations in place to save a temporary (``x.mul_(scale)``).

    The output is right, but the caller's ``x`` is changed: the next layer or slice reading it gets a
    scaled copy. Inputs are read-only in every op's contract."""

    name = "fault-scales-input-in-place"

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, *metadata_and_scaling):
        *metadata, scaling = metadata_and_scaling
        inputs.mul_(scaling)
        super().lora_shrink(inputs, lora_a_weights, output_tensor, *metadata, 1.0)


class ScaleIgnored(PlainTorchTarget):
    """The shrink ignores ``scale``: the first Gaudi wrapper passed 1.0 whatever the caller asked for.

    PR vllm#10565 before review (docs/vllm-lora-ops.md §6)."""

    name = "fault-scale-ignored"

    def apply_scale(self, product, scale):
        return product


class AddInputsIgnored(PlainTorchTarget):
    """The expand always accumulates, ``add_inputs=False`` is ignored.

    vLLM's XPU wrapper hard-coded ``add_inputs=True`` (vllm#45368); the GPU wrapper ignores it too."""

    name = "fault-add-inputs-ignored"

    def write_expand(self, out, delta, rows, offset, add_inputs):
        super().write_expand(out, delta, rows, offset, True)


class NoAdapterRowsOverwritten(PlainTorchTarget):
    """``add_inputs=False`` overwrites every row, so rows of slot −1 are zeroed.

    vLLM's torch ops compute every row and assign ``out[:, cols] = delta`` (docs/vllm-lora-ops.md §2.3, torch_ops
    difference 3); the Triton kernels never touch rows of slot −1."""

    name = "fault-no-adapter-rows-overwritten"

    def rows_written(self, slots, add_inputs):
        return torch.ones_like(slots, dtype=torch.bool) if not add_inputs else super().rows_written(slots, add_inputs)


class SliceOffsetLagsOneSlice(PlainTorchTarget):
    """Slice ``s`` lands at the column where slice ``s−1`` should start (prefix sum shifted by one).

    The running column offset of packed (QKV / gate-up) slices is an exclusive prefix sum; taking it
    one slice late makes the second slice overwrite the first."""

    name = "fault-slice-offset-lags"

    def slice_offsets(self, widths, offset_start):
        offsets = super().slice_offsets(widths, offset_start)
        return [offsets[max(s - 1, 0)] for s in range(len(offsets))]


class FirstSliceWeightsForAllSlices(PlainTorchTarget):
    """Every slice of a packed shrink reads slice 0's LoRA-A stack.

    ``lora_shrink`` builds a per-slice pointer table, cached by ``data_ptr`` (vllm#50820 is the same
    cache on the expand side); a stale or one-entry table makes q, k and v share one adapter."""

    name = "fault-first-slice-weights"

    def shrink_stacks(self, lora_a_weights):
        first = as_3d(lora_a_weights[0])
        return [first for _ in lora_a_weights]


class UnsortedActiveLoraIds(PlainTorchTarget):
    """``lora_*`` metadata with the active ids in first-appearance order, not increasing order.

    vllm#15979 (fixed by #16040): ``torch.unique(sorted=False)`` lists the ids in an order that does
    not match ``token_indices_sorted_by_lora_ids`` (a stable sort by slot), so segments get the wrong
    adapter. Modelled in ``update_metadata`` (the kernel ops receive the suite's correct metadata)."""

    name = "fault-unsorted-lora-ids"

    def kernel_meta(self, slots, num_slots):
        slots = slots.reshape(-1).to(torch.int32)
        first_seen = list(dict.fromkeys(slots.tolist()))
        counts = [int((slots == s).sum()) for s in first_seen]
        ids = torch.full((num_slots + 1,), -1, dtype=torch.int32)
        per_id = torch.zeros(num_slots + 1, dtype=torch.int32)
        starts = torch.zeros(num_slots + 2, dtype=torch.int32)
        ids[: len(first_seen)] = torch.tensor(first_seen, dtype=torch.int32)
        per_id[: len(counts)] = torch.tensor(counts, dtype=torch.int32)
        starts[1 : len(counts) + 1] = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        meta = LoRAKernelMeta(
            token_lora_mapping=slots,
            token_indices_sorted_by_lora_ids=torch.sort(slots, stable=True).indices.to(torch.int32),
            num_tokens_per_lora=per_id,
            lora_token_start_loc=starts,
            active_lora_ids=ids,
            no_lora_flag_cpu=torch.tensor([bool((slots == -1).all())]),
        )
        return meta.to(self.device)


class LogitsUseTokenMapping(PlainTorchTarget):
    """The logits rows are indexed with the per-token mapping instead of the sampled rows' mapping.

    vllm#16668 / #24081 class: the logits op narrowed the wrong index buffer (per-token slots cut to
    the number of sampled rows), so a request's logits get another request's adapter."""

    name = "fault-logits-token-mapping"

    def update_metadata(self, mapping):
        super().update_metadata(mapping)
        wrong = mapping.token_slot_tensor()[: len(mapping.sampled_slots)]
        self.sampled_meta = self.kernel_meta(wrong, mapping.num_slots)
        self.sampled_indices = wrong.to(self.device)


def sum_in_storage_dtype(inputs: torch.Tensor, weights: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """``inputs @ weightsᵀ`` with each ``chunk``-wide partial product exact but the running sum kept in
    the weights' dtype (fp16/bf16; float32 weights sum in float32)."""
    if weights.dtype == torch.float32:
        return inputs.float() @ weights.float().T
    total = torch.zeros(inputs.size(0), weights.size(0), dtype=weights.dtype, device=inputs.device)
    for k in range(0, inputs.size(1), chunk):
        total += (inputs[:, k : k + chunk].float() @ weights[:, k : k + chunk].float().T).to(weights.dtype)
    return total.float()


class LowPrecisionAccumulation(PlainTorchTarget):
    """Products are summed in the storage dtype (fp16/bf16) in chunks of 32 along K.

    The classic "accumulator in the input dtype" kernel bug (vllm#33704 / #38686 class: intermediate
    precision loss): each 32-wide partial product is exact in float32, the running sum is not."""

    name = "fault-low-precision-accumulation"

    def accumulate(self, inputs, weights):
        return sum_in_storage_dtype(inputs, weights)


class ShrinkStoresInInputDtype(PlainTorchTarget):
    """The shrink result passes through the activation dtype before the float32 buffer.

    The LoRA intermediate buffer allocated in the input dtype instead of float32 (vllm#33704,
    PR #38686; docs/vllm-lora-ops.md §8 #9): the shrink output loses its float32 precision."""

    name = "fault-shrink-in-input-dtype"

    def store_shrink(self, product, out_dtype, in_dtype):
        return product.to(in_dtype).to(out_dtype)


class RankTailIgnored(PlainTorchTarget):
    """The expand reads rank columns in blocks of 16 without a tail mask: the last ``R mod 16`` are dropped.

    The "no suitable kernel" / block-divisibility class (vllm#3793, #4708): a kernel tuned for ranks that
    are multiples of 16 silently loses the rest (rank 8 gives no delta at all)."""

    name = "fault-rank-tail-ignored"

    def rank_columns(self, rank):
        return rank - rank % 16


class ExpandWritesPastSlice(PlainTorchTarget):
    """The expand writes whole 16-column blocks: columns past the slice get products of stale weights.

    The column mask checks the block, not ``N`` (bgmv_expand's ``SPLIT_N`` masking, docs/vllm-lora-ops.md §2.2); the
    rows read past ``B[l]``'s end are the next slot's (zeros past the stack)."""

    name = "fault-expand-writes-past-slice"

    def expanded_width(self, lora_b):
        return -(-lora_b.size(1) // 16) * 16


class SgmvInclusiveSeqStarts(PlainTorchTarget):
    """sgmv segments start at the inclusive prefix sum of the lengths instead of ``b_seq_start_loc``.

    The exclusive/inclusive cumsum swap (docs/vllm-lora-ops.md §8, synthetic list): every segment is shifted by its
    own length; rows past the end are dropped."""

    name = "fault-sgmv-inclusive-starts"

    def slots_of_segments(self, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, rows):
        inclusive = torch.cumsum(seq_len_tensor, 0)
        return super().slots_of_segments(inclusive, seq_len_tensor, lora_indices_tensor, rows)


class SgmvIgnoresSeqStartLoc(PlainTorchTarget):
    """sgmv ignores ``b_seq_start_loc``: segment slots are repeated by length from row 0.

    vLLM's CPU torch ops (``repeat_interleave(lora_indices, seq_len)``, docs/vllm-lora-ops.md §2.3 difference 5)
    assume the segments are contiguous from row 0 and cover every row."""

    name = "fault-sgmv-ignores-seq-start-loc"

    def slots_of_segments(self, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, rows):
        repeated = torch.repeat_interleave(lora_indices_tensor.long(), seq_len_tensor.long())[:rows]
        return torch.cat([repeated, repeated.new_full((rows - repeated.numel(),), -1)])


class BiasOnNoAdapterRows(PlainTorchTarget):
    """The LoRA bias is gathered for every row, so rows of slot −1 get the last slot's bias.

    vLLM's ``_apply_bias`` gathers ``bias[indices]`` and must then zero the −1 rows; forgetting that step
    is negative indexing again (vllm#10844 was another bias-indexing bug)."""

    name = "fault-bias-on-no-adapter-rows"

    def apply_bias(self, y2d, lora_bias_stacked, output_slices, offset_start):
        slots = self.token_indices
        column = offset_start
        for bias, width in zip(lora_bias_stacked, output_slices, strict=True):
            if bias is not None:
                cols = slice(column, column + width)
                y2d[:, cols] = (y2d[:, cols].float() + bias.reshape(bias.size(0), -1)[slots].float()).to(y2d.dtype)
            column += width


class BiasScaled(PlainTorchTarget):
    """The LoRA bias is multiplied by ``scale`` like the LoRA delta (it must not be)."""

    name = "fault-bias-scaled"

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                        lora_bias_stacked=None, **kwargs):
        if lora_bias_stacked is not None:
            lora_bias_stacked = tuple(None if b is None else b * scale for b in lora_bias_stacked)
        super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer,
                                lora_bias_stacked=lora_bias_stacked, **kwargs)


class BiasIgnoresOffsetStart(PlainTorchTarget):
    """The LoRA bias is added from column 0, ignoring ``offset_start``: vLLM's ``_apply_bias`` does this.

    Row-parallel fully-sharded layers expand at ``offset_start = tp_rank · shard``; the bias lands in
    rank 0's columns."""

    name = "fault-bias-ignores-offset"

    def apply_bias(self, y2d, lora_bias_stacked, output_slices, offset_start):
        super().apply_bias(y2d, lora_bias_stacked, output_slices, 0)


class CastTypeSkipped(PlainTorchTarget):
    """A float32 expand input is not rounded to the weight dtype (Triton's ``CAST_TYPE`` skipped).

    A deviation from vLLM's kernels, but towards the exact result: the float64 oracle does not round
    either, so the verdict (budget = k · baseline error) accepts it by design."""

    name = "fault-cast-type-skipped"

    def cast_expand_input(self, x, weight_dtype):
        return x


class ExpandLowPrecisionAccumulation(PlainTorchTarget):
    """:class:`LowPrecisionAccumulation` on the expand side only (K = rank ≤ 64: one or two chunks)."""

    name = "fault-expand-low-precision-accumulation"

    def expand_product(self, tiled, flat_b):
        return sum_in_storage_dtype(tiled, flat_b)


FAULTS: tuple[type[PlainTorchTarget], ...] = (
    NegativeIndexIsLastSlot,
    SlotIdUsedAsSlot,
    MaskBlockOffByOne,
    LastSlotNeverApplied,
    ScaleAppliedTwice,
    ScaleIgnored,
    AddInputsIgnored,
    NoAdapterRowsOverwritten,
    SliceOffsetLagsOneSlice,
    FirstSliceWeightsForAllSlices,
    UnsortedActiveLoraIds,
    LogitsUseTokenMapping,
    LowPrecisionAccumulation,
    ShrinkStoresInInputDtype,
    RankTailIgnored,
    ExpandWritesPastSlice,
    SgmvInclusiveSeqStarts,
    BiasOnNoAdapterRows,
    BiasScaled,
    BiasIgnoresOffsetStart,
    ScalesInputInPlace,
)
"""Faults the smoke profile must catch (at least one case ends FAIL)."""

UNCAUGHT_BY_DESIGN: dict[type[PlainTorchTarget], str] = {
    SgmvIgnoresSeqStartLoc: "the sgmv cases' segments always start at row 0 and cover every row",
    CastTypeSkipped: "more accurate than the baseline: the float64 oracle does not round the input either",
    ExpandLowPrecisionAccumulation: "K = rank ≤ 64 gives at most a few bf16 roundings, inside k × the baseline error",
}
"""Genuine deviations the smoke profile cannot flag today, and why (strict xfails in test_fault_catalog.py)."""
