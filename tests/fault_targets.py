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

The fused-MoE kernels (docs/moe.md) use the same mask over (slot, expert): each (token, choice)
pair's row is multiplied by all ``L·E`` matrices, a ``[P, L·E·R]`` one-hot mask keeps the pair's own,
and the (slot, expert) of each pair is read from the metadata as vLLM's Triton kernel walks it
(block-aligned or naive). Rounding as that kernel's: float32 accumulation, the shrink intermediate
rounded to the output dtype, the routing weight multiplied into the float32 product, the delta
rounded to the output dtype, added in float32 and rounded once. ``moe_lora_align_block_size`` is
written from the op's definition (stable sort by local expert, groups padded with ``T·top_k``).
Neither calls ``conformance.reference``; the wrapper's MoE methods come from ``KernelTarget``.

Each fault below is a subclass changing one method, with a docstring naming the real bug it models.
``FAULTS`` lists those the smoke profile must catch; ``UNCAUGHT_BY_DESIGN`` those it cannot, and why.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from conformance.ops import OP_SPECS
from conformance.reference import LoRAKernelMeta
from conformance.targets.base import Target
from conformance.targets.kernel_target import KernelTarget
from conformance.targets.reference import ReferenceTarget
from conformance.verdict.metrics import bitwise_differences


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


    # -- lora_shrink_fp8 / lora_expand_fp8: dequantize to float32, then the mask-based ops above ------

    def lora_shrink_fp8(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling,
                        b_scale, a_scale=None, group_k=0, group_n=0, use_fp8_w8a8=False, per_channel_quant=False):
        if bool(no_lora_flag_cpu.item()):
            return
        slots = self.fp8_slots(self.slots_of_kernel_meta(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                         lora_token_start_loc, lora_ids, inputs.size(0)))
        quant = (group_k, group_n, per_channel_quant) if use_fp8_w8a8 else None
        x, stacks = self.fp8_operands(inputs, a_scale, [as_3d(a) for a in lora_a_weights], b_scale, quant)
        for s, lora_a in enumerate(stacks):
            self.shrink_rows(x, lora_a, output_tensor[s], slots, scaling)

    def lora_expand_fp8(self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, b_scale,
                        a_scale=None, offset_start=0, add_inputs=False, group_k=0, group_n=0, use_fp8_w8a8=False,
                        per_channel_quant=False):
        if bool(no_lora_flag_cpu.item()):
            return
        slots = self.fp8_slots(self.slots_of_kernel_meta(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                         lora_token_start_loc, lora_ids, inputs.size(1)))
        quant = (group_k, group_n, per_channel_quant) if use_fp8_w8a8 else None
        stacks = [as_3d(b) for b in lora_b_weights]
        offsets = self.slice_offsets([b.size(1) for b in stacks], offset_start)
        for s, (lora_b, offset) in enumerate(zip(stacks, offsets)):
            x, (weights,) = self.fp8_operands(inputs[s], a_scale, [lora_b], [b_scale[s]], quant)
            self.expand_rows(x, weights, output_tensor, slots, offset, add_inputs)

    def fp8_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The slot each row of an fp8 op reads (−1: none; the kernels exit early on it)."""
        return slots

    def fp8_operands(self, codes, a_scale, stacks, b_scales, quant):
        """The activations ``[T, K]`` and each ``[L, N, K]`` weight stack as float32 values: ``code · scale``.
        ``quant``: ``(group_k, group_n, per_channel_quant)``, or None without ``use_fp8_w8a8`` (no scale read)."""
        if quant is None:
            return codes.float(), [w.float() for w in stacks]
        group_k, group_n, per_channel = quant
        mode = "block" if group_k > 0 and group_n > 0 else "channel" if per_channel else "tensor"
        x = self.fp8_values(codes) * self.activation_scale_of(a_scale.float(), mode, codes.shape, group_k)
        weights = [self.fp8_values(w) * self.weight_scale_of(s.float(), mode, w.shape, group_k, group_n) for w, s in zip(stacks, b_scales)]
        return x, weights

    def fp8_values(self, codes: torch.Tensor) -> torch.Tensor:
        """What e4m3fn codes stand for, in float32 (exact: every code is a float32 number)."""
        return codes.float()

    def scale_block(self, size: int, group: int, device) -> torch.Tensor:
        """Which block of ``group`` elements each of ``size`` positions falls in."""
        return torch.arange(size, device=device) // group

    def activation_scale_of(self, a_scale, mode: str, shape, group_k: int) -> torch.Tensor:
        """The scale of each activation ``[T, K]``: one, one per token (``[T, 1]``), one per token and K-block."""
        rows, k = shape
        if mode == "block":
            return a_scale.reshape(rows, -1)[:, self.scale_block(k, group_k, a_scale.device)]
        return a_scale.reshape(rows, 1) if mode == "channel" else a_scale.reshape(-1)[0]

    def weight_scale_of(self, b_scale, mode: str, shape, group_k: int, group_n: int) -> torch.Tensor:
        """The scale of each weight ``[L, N, K]``: one per slot, per slot and output channel, per slot and block."""
        slots, n, k = shape
        if mode == "block":
            per_block = b_scale.reshape(slots, -1, b_scale.size(-1))
            rows, columns = self.scale_block(n, group_n, b_scale.device), self.scale_block(k, group_k, b_scale.device)
            return per_block[:, rows][:, :, columns]
        return b_scale.reshape(slots, n, 1) if mode == "channel" else b_scale.reshape(slots, 1, 1)

    # -- fused_moe_lora_fp8: every (slot, expert) dequantized to float32 as a slot, then fused_moe_lora's math --

    def fused_moe_lora_fp8(self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids,
                           expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids,
                           num_active_loras, adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k,
                           shrink_group_size_m, shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m,
                           expand_block_size_n, expand_block_size_k, expand_group_size_m, expand_num_warps, expand_num_stages,
                           expand_split_k, lora_a_scale_stacked, lora_b_scale_stacked, shrink_act_scale=None,
                           expand_act_scale=None, mul_routed_weight=False, fully_sharded=False, offset=0, use_fp8_w8a8=False,
                           use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, block_shape=None):
        # vLLM's intermediate is a buffer in the output dtype, read by the expand as it is: no expand_act_scale
        # to apply (the suite passes none), and the op always adds (no add_inputs)
        if use_int8_w8a8 or use_int8_w8a16 or expand_act_scale is not None:
            raise ValueError("this target takes fp8 operands and no expand_act_scale")
        group_n, group_k = block_shape if block_shape is not None else (0, 0)
        quant = (group_k, group_n, per_channel_quant) if use_fp8_w8a8 else None
        # one method dequantizes every operand (a fault in it reaches both stacks): the activations come back
        # from the LoRA-B call too and are dropped
        x, a_flat = self.fp8_operands(qcurr_hidden_states, shrink_act_scale, [self.expert_slots(a) for a in lora_a_stacked],
                                      self.expert_slot_scales(lora_a_scale_stacked, quant), quant)
        _, b_flat = self.fp8_operands(qcurr_hidden_states, shrink_act_scale, [self.expert_slots(b) for b in lora_b_stacked],
                                      self.expert_slot_scales(lora_b_scale_stacked, quant), quant)
        a_stacks = [a.view(stack.shape) for a, stack in zip(a_flat, lora_a_stacked)]
        b_stacks = [b.view(stack.shape) for b, stack in zip(b_flat, lora_b_stacked)]
        self.moe_into(output, x, a_stacks, b_stacks, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      token_lora_mapping, top_k_num, lora_ids, adapter_enabled, shrink_block_size_m, mul_routed_weight, offset,
                      add_inputs=True)

    def expert_slots(self, stack: torch.Tensor) -> torch.Tensor:
        """An ``[L, E, N, K]`` stack as ``[L·E, N, K]``: each (slot, expert) one slot of the dense fp8 helpers."""
        return stack.reshape(-1, *stack.shape[2:])

    def expert_slot_scales(self, scales, quant) -> list[torch.Tensor] | None:
        """The scales in the dense layouts over ``L·E`` slots: ``[L·E]``, ``[L·E, N]``, ``[L·E, ⌈N/gn⌉, ⌈K/gk⌉]``."""
        if quant is None:
            return scales
        group_k, group_n, per_channel = quant
        if group_k > 0 and group_n > 0:
            return [s.reshape(-1, *s.shape[2:]) for s in scales]
        return [s.reshape(s.size(0) * s.size(1), -1) if per_channel else s.reshape(-1) for s in scales]

    # -- fused_moe_lora / moe_lora_align_block_size (the module docstring says how) ------------------

    def fused_moe_lora(self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids,
                       expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids,
                       num_active_loras, adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k,
                       shrink_group_size_m, shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m,
                       expand_block_size_n, expand_block_size_k, expand_group_size_m, expand_num_warps, expand_num_stages,
                       expand_split_k, mul_routed_weight=False, fully_sharded=False, offset=0, add_inputs=True):
        # the Triton tile parameters other than shrink_block_size_m (the alignment's block) do not change
        # the result; fully_sharded at one rank means the collective between shrink and expand is the identity
        self.moe_into(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                      num_tokens_post_padded, token_lora_mapping, top_k_num, lora_ids, adapter_enabled, shrink_block_size_m,
                      mul_routed_weight, offset, add_inputs)

    def moe_into(self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                 num_tokens_post_padded, token_lora_mapping, top_k_num, lora_ids, adapter_enabled, block_m: int,
                 mul_routed_weight: bool, offset: int, add_inputs: bool) -> None:
        """The MoE ops' math (``fused_moe_lora``, and ``fused_moe_lora_fp8`` on dequantized stacks): not an op
        itself, so removing one kernel of this target leaves the other whole."""
        num_tokens, top_k = topk_weights.shape
        if top_k != top_k_num:
            raise ValueError(f"topk_weights has {top_k} choices per token, top_k_num is {top_k_num}")
        num_pairs = num_tokens * top_k
        num_slots, num_experts, rank, _ = lora_a_stacked[0].shape
        if sorted_token_ids is None:
            slots, experts = self.naive_routing(expert_ids, token_lora_mapping, adapter_enabled, num_slots, top_k)
        else:
            slots, experts = self.aligned_routing(sorted_token_ids, expert_ids, num_tokens_post_padded, lora_ids,
                                                  adapter_enabled, num_slots, block_m, num_pairs)
        experts = self.kernel_experts(experts, num_experts)
        served = (slots != -1) & (experts != -1) & self.pairs_walked(num_pairs, top_k)
        x = qcurr_hidden_states[self.input_rows(num_pairs, top_k, mul_routed_weight)]  # [P, K]
        weights = self.pair_weights(topk_weights, mul_routed_weight)
        mask = self.expert_mask(slots, experts, served, num_slots, num_experts, rank)
        out = output.view(num_pairs, -1)
        width = lora_b_stacked[0].size(2)
        columns = self.moe_slice_columns(len(lora_b_stacked), width, offset)
        for lora_a, lora_b, column in zip(lora_a_stacked, lora_b_stacked, columns):
            flat_a = self.flat_experts(lora_a).reshape(num_slots * num_experts * rank, -1)  # [L·E·R, K]
            flat_b = self.flat_experts(lora_b).permute(1, 0, 2).reshape(width, -1)  # [N, L·E·R]
            delta = self.moe_delta(x, flat_a, flat_b, mask, weights, rank, out.dtype)
            self.write_expand(out, delta, served, column, add_inputs)

    def naive_routing(self, expert_ids, token_lora_mapping, adapter_enabled, num_slots: int, top_k: int):
        """One pair per program: its slot is its token's, its expert ``expert_ids[p]``."""
        slots = self.resolve_pair_slots(token_lora_mapping.long().repeat_interleave(top_k), num_slots)
        slots = torch.where(self.slot_enabled(adapter_enabled, slots, num_slots), slots, -1)
        return slots, expert_ids.reshape(-1).long()

    def aligned_routing(self, sorted_token_ids, expert_ids, num_tokens_post_padded, lora_ids, adapter_enabled,
                        num_slots: int, block: int, num_pairs: int):
        """Per active, enabled slot of ``lora_ids``: the blocks below ``⌈num_tokens_post_padded / block⌉`` whose
        expert is not −1; the ids in them below ``T·top_k`` are that slot's and block's pairs."""
        sorted_ids = sorted_token_ids.reshape(num_slots, -1).long()
        block_experts = expert_ids.reshape(num_slots, -1).long()
        ids = lora_ids.reshape(-1).long()
        every_slot = torch.arange(num_slots, device=ids.device)
        active = torch.isin(every_slot, ids) & self.slot_enabled(adapter_enabled, every_slot, num_slots)
        walked_blocks = (num_tokens_post_padded.long().clamp(min=0) + block - 1) // block  # [L]
        block_of_entry = torch.arange(sorted_ids.size(1), device=ids.device) // block
        inside = block_of_entry < block_experts.size(1)
        entry_expert = torch.full_like(sorted_ids, -1)
        entry_expert[:, inside] = block_experts[:, block_of_entry[inside]]
        valid = (
            active[:, None] & (block_of_entry[None, :] < walked_blocks[:, None]) & (entry_expert >= 0)
            & (sorted_ids >= 0) & (sorted_ids < num_pairs)
        )  # fmt: skip
        slots = torch.full((num_pairs,), -1, dtype=torch.long, device=ids.device)
        experts = torch.full((num_pairs,), -1, dtype=torch.long, device=ids.device)
        slots[sorted_ids[valid]] = every_slot[:, None].expand_as(sorted_ids)[valid]
        experts[sorted_ids[valid]] = entry_expert[valid]
        return slots, experts

    def resolve_pair_slots(self, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
        """The slot whose weights each pair reads (−1: none)."""
        return slots

    def slot_enabled(self, adapter_enabled: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
        """bool per entry of ``slots``: a slot of the stacks whose ``adapter_enabled`` is set."""
        inside = (slots >= 0) & (slots < num_slots)
        return inside & (adapter_enabled.long()[slots.clamp(0, num_slots - 1)] != 0)

    def kernel_experts(self, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The expert whose weights each pair reads (−1: not local, skipped)."""
        return experts

    def pairs_walked(self, num_pairs: int, top_k: int) -> torch.Tensor:
        """bool ``[P]``: the pairs the kernel visits (all of them)."""
        return torch.ones(num_pairs, dtype=torch.bool, device=self.device)

    def input_rows(self, num_pairs: int, top_k: int, mul_routed_weight: bool) -> torch.Tensor:
        """The input row of each pair: ``p`` when ``x`` has one row per pair (w2), else its token ``p // top_k``."""
        pairs = torch.arange(num_pairs, device=self.device)
        return pairs if mul_routed_weight else pairs // top_k

    def pair_weights(self, topk_weights: torch.Tensor, mul_routed_weight: bool) -> torch.Tensor | None:
        """float32 ``[P]``: the routing weight multiplied into each pair's delta, or None (w13)."""
        return topk_weights.reshape(-1).float() if mul_routed_weight else None

    def expert_mask(self, slots, experts, served, num_slots: int, num_experts: int, rank: int) -> torch.Tensor:
        """float32 ``[P, L·E·R]``: ones in the rank block ``slot·E + expert`` of a served pair, zeros elsewhere."""
        blocks = torch.where(served, slots * num_experts + experts, -1)
        return self.slot_mask(blocks, num_slots * num_experts, rank)

    def flat_experts(self, stack: torch.Tensor) -> torch.Tensor:
        """``[L, E, rows, cols]`` as ``[L·E, rows, cols]``, read through its strides (a shared stack has stride 0)."""
        return stack.reshape(-1, stack.size(2), stack.size(3))

    def moe_slice_columns(self, num_slices: int, width: int, offset: int) -> list[int]:
        """First output column of each slice: ``offset + s·N`` (gate, then up)."""
        return [offset + s * width for s in range(num_slices)]

    def round_intermediate(self, shrunk: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The shrink result the expand reads: in the output dtype, as vLLM's kernel keeps it."""
        return shrunk.to(out_dtype)

    def moe_delta(self, x, flat_a, flat_b, mask, weights, rank: int, out_dtype) -> torch.Tensor:
        """``round(w · round(x @ A[l, e]ᵀ) @ B[l, e]ᵀ)`` for every pair, in the output dtype."""
        every_block = self.shrink_product(x, flat_a) * mask  # [P, L·E·R]: only the pair's own block survives
        shrunk = every_block.view(x.size(0), -1, rank).sum(dim=1)  # [P, R], exact: one non-zero term per column
        shrunk = self.round_intermediate(shrunk, out_dtype).float()
        tiled = shrunk.repeat(1, mask.size(1) // rank) * mask
        delta = self.expand_product(tiled, flat_b)  # [P, N], float32
        if weights is not None:
            delta = delta * weights[:, None]  # into the float32 product, before it is rounded
        return delta.to(out_dtype)

    def moe_lora_align_block_size(self, topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                                  max_num_tokens_padded, max_num_m_blocks, sorted_token_ids, experts_ids,
                                  num_tokens_post_pad, adapter_enabled, lora_ids, expert_map=None):
        """Per active, enabled slot: its pairs with a local expert, stably sorted by expert, each expert's
        group padded to whole blocks with the id ``T·top_k``; unused blocks get expert −1."""
        num_pairs = topk_ids.numel()
        experts = self.align_experts(topk_ids, expert_map)
        slots = self.resolve_pair_slots(token_lora_mapping.long().repeat_interleave(topk_ids.size(-1)), max_loras)
        sorted_rows = sorted_token_ids.view(max_loras, max_num_tokens_padded)
        expert_rows = experts_ids.view(max_loras, max_num_m_blocks)
        ids = lora_ids.reshape(-1).long()
        active = ids[self.slot_enabled(adapter_enabled, ids, max_loras)]
        for slot in active.tolist():
            pairs = torch.nonzero((slots == slot) & (experts >= 0)).flatten()
            row, blocks = self.align_one_slot(pairs, experts[pairs], num_experts, block_size, num_pairs)
            if row.numel() > max_num_tokens_padded or blocks.numel() > max_num_m_blocks:
                raise ValueError(f"slot {slot}: {row.numel()} aligned ids do not fit max_num_tokens_padded {max_num_tokens_padded}")
            sorted_rows[slot] = self.padding_id(num_pairs)
            sorted_rows[slot, : row.numel()] = row.to(sorted_rows.dtype)
            expert_rows[slot] = self.unused_block_expert(blocks)
            expert_rows[slot, : blocks.numel()] = blocks.to(expert_rows.dtype)
            num_tokens_post_pad[slot] = row.numel()

    def align_experts(self, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
        """The local expert of every pair ``[T·top_k]``: ``expert_map[topk_ids]`` (−1: on another rank)."""
        experts = topk_ids.reshape(-1).long()
        return experts if expert_map is None else expert_map.long()[experts]

    def align_one_slot(self, pairs, pair_experts, num_experts: int, block: int, num_pairs: int):
        """``(row, blocks)``: one slot's sorted ids and the expert of each of its blocks."""
        order = torch.sort(pair_experts, stable=True).indices
        pairs, pair_experts = pairs[order], pair_experts[order]
        counts = torch.bincount(pair_experts, minlength=num_experts)
        padded = (counts + block - 1) // block * block
        group_start = torch.cumsum(padded, 0) - padded
        rank_in_group = torch.arange(pairs.numel(), device=pairs.device) - (torch.cumsum(counts, 0) - counts)[pair_experts]
        positions, kept = self.pair_positions(group_start[pair_experts], rank_in_group, padded[pair_experts])
        row = torch.full((int(padded.sum()),), self.padding_id(num_pairs), dtype=torch.long, device=pairs.device)
        row[positions[kept]] = pairs[kept]
        blocks = torch.repeat_interleave(torch.arange(num_experts, device=pairs.device), padded // block)
        return row, blocks

    def pair_positions(self, group_start, rank_in_group, group_length):
        """Where each pair goes in the slot's row, and whether it is written (always)."""
        return group_start + rank_in_group, torch.ones_like(rank_in_group, dtype=torch.bool)

    def padding_id(self, num_pairs: int) -> int:
        """The id that fills a group's last block: ``T·top_k``, out of range, so the kernel masks it."""
        return num_pairs

    def unused_block_expert(self, blocks: torch.Tensor) -> int:
        """The expert of the blocks after ``num_tokens_post_pad``: −1, so the kernel skips them."""
        return -1


class PlainTorchClassicTarget(PlainTorchTarget):
    """The same kernels with the wrapper methods composed like vLLM's CPU wrapper (sgmv / bgmv ops)."""

    name = "plain-torch-classic"
    wrapper_paths = ("classic",)


class Float32IntermediateTarget(PlainTorchTarget):
    """Correct, rounding elsewhere: the MoE shrink intermediate stays in float32 (as Gaudi-like code keeps
    it) instead of being rounded to the output dtype as vLLM's Triton kernel does."""

    name = "plain-torch-fp32-intermediate"

    def round_intermediate(self, shrunk, out_dtype):
        return shrunk


class WeightAfterRoundingTarget(PlainTorchTarget):
    """Correct, rounding elsewhere: w2's routing weight multiplies the delta after it is rounded to the
    output dtype (an epilogue in the storage dtype) instead of the float32 product."""

    name = "plain-torch-weight-after-rounding"

    def moe_delta(self, x, flat_a, flat_b, mask, weights, rank, out_dtype):
        delta = super().moe_delta(x, flat_a, flat_b, mask, None, rank, out_dtype)
        return delta if weights is None else (delta.float() * weights[:, None]).to(out_dtype)


class ActivationDtypeIntermediateTarget(PlainTorchTarget):
    """Correct, rounding elsewhere: the fused wrappers (``add_lora_linear``, ``add_lora_logits``) keep
    their shrink intermediate in the activation dtype, as Gaudi's extension ops do: ``x @ Aᵀ`` comes out
    of a GEMM in the activation dtype (rounded once), is scaled there (rounded again) and is then
    expanded. Two roundings of a per-row intermediate instead of vLLM's one (``CAST_TYPE``): with rank 1
    an error of up to two units of roundoff exactly proportional to each row's delta."""

    name = "plain-torch-activation-dtype-intermediate"

    def activation_dtype_intermediate(self, x, lora_a_stacked, scale: float) -> torch.Tensor:
        """``[S, T, R]`` in ``x``'s dtype: ``round(round(x @ A_s[slot]ᵀ) · scale)``."""
        rank = lora_a_stacked[0].size(-2)
        buffer = self.zero_buffer(len(lora_a_stacked), x.size(0), rank)
        self.add_shrink(buffer, x, lora_a_stacked, 1.0)
        return buffer.to(x.dtype) * scale

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                        lora_bias_stacked=None, add_inputs=True, **kwargs):
        x = x.reshape(-1, x.size(-1))
        intermediate = self.activation_dtype_intermediate(x, lora_a_stacked, scale)
        self.add_expand(y, intermediate, lora_b_stacked, output_slices, 0, add_inputs, lora_bias_stacked=lora_bias_stacked)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        y2d, x = y.view(-1, y.size(-1)), x.reshape(-1, x.size(-1))
        slots = self.sampled_indices
        intermediate = self.zero_buffer(1, x.size(0), lora_a_stacked.size(-2))[0]
        self.bgmv_shrink(x, lora_a_stacked, intermediate, slots, 1.0)
        self.bgmv_expand(intermediate.to(x.dtype) * scale, lora_b_stacked, y2d, slots, True)


class Float32ReferenceTarget(Target):
    """Correct, rounding elsewhere: the golden reference run on float32 copies of every floating-point
    tensor, its output rounded once to the case dtype at the end (no rounding of the delta before it is
    added, nor of the shrink result before the expand, as vLLM's kernels round)."""

    name = "reference-float32"
    description = "the golden reference computing in float32, rounded to the case dtype once (tests only)"

    def __init__(self) -> None:
        super().__init__()
        self.reference = ReferenceTarget()

    def update_metadata(self, mapping) -> None:
        self.reference.update_metadata(mapping)

    def __getattr__(self, name: str):
        if name not in OP_SPECS:
            raise AttributeError(name)
        op = getattr(self.reference, name)

        def in_float32(*args, **kwargs):
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (caller's tensor, its float32 copy)
            op(*_float32_copies(args, pairs), **_float32_copies(kwargs, pairs))
            for caller, copy in pairs:
                rounded = copy.to(caller.dtype)
                if bitwise_differences(rounded, caller).any():  # the outputs only: an input may be a stride-0 view
                    caller.copy_(rounded)

        return in_float32


def _float32_copies(value, pairs: list):
    """``value`` with every 16-bit floating tensor replaced by a float32 copy (recorded in ``pairs``),
    through tuples, lists and dicts; float32 tensors are passed as they are (written in place)."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        copy = value.float()
        pairs.append((value, copy))
        return copy
    if isinstance(value, (tuple, list)):
        return type(value)(_float32_copies(v, pairs) for v in value)
    if isinstance(value, dict):
        return {k: _float32_copies(v, pairs) for k, v in value.items()}
    return value


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


class BaseRowsGetSlotZeroInOneLayer(PlainTorchTarget):
    """Rows without adapter (slot −1) get slot 0's delta in one call of each forward pass: the first
    ``add_lora_linear`` after ``update_metadata`` (layer 0's packed q/k/v projection in every fixture model).

    Enabling LoRA changes what requests without an adapter generate (vllm#49063: greedy outputs of base
    requests changed once LoRA was enabled), on one layer only, as a path taken by one kind of projection
    would. End to end, base requests fail as ``changed base requests`` and nothing else fails."""

    name = "fault-base-rows-get-slot0-in-one-layer"
    _calls = 0
    _hit = False

    def update_metadata(self, mapping):
        super().update_metadata(mapping)
        self._calls = 0

    def add_lora_linear(self, *args, **kwargs):
        self._hit, self._calls = self._calls == 0, self._calls + 1
        try:
            return super().add_lora_linear(*args, **kwargs)
        finally:
            self._hit = False

    def resolve_slots(self, slots, num_slots):
        return torch.where(slots == -1, 0, slots) if self._hit else slots


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


class ScaleRoundedToInputDtype(PlainTorchTarget):
    """The shrink takes ``scale`` as a tensor of the activations' dtype (``torch.tensor(scale, dtype=x.dtype)``,
    or a kernel argument typed like the activations), so an ``alpha / r`` of 4/3 or an rsLoRA ``alpha / √r``
    arrives rounded: every delta carries the same gain, up to 2⁻⁹ in bfloat16 and 2⁻¹² in float16, each
    element inside the budget. Only the systematic rule sees it, on a case whose scale the dtype does not
    hold (``conformance.cases.scales``) and with enough rows; the standard profile must catch it in both
    16-bit dtypes (``test_fault_catalog``)."""

    name = "fault-scale-rounded-to-input-dtype"

    def shrink_rows(self, x, lora_a, out, slots, scale):
        super().shrink_rows(x, lora_a, out, slots, float(torch.tensor(scale, dtype=torch.float64).to(x.dtype)))


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


class SgmvStoresUncoveredRows(PlainTorchTarget):
    """sgmv expands store every row of the batch: a row no segment covers gets a zero delta, stored.

    A kernel launched over all ``token_nums`` rows that looks each row's segment up in ``b_seq_start_loc``
    and, finding none, still stores ``(out if add_inputs else 0) + 0``: with ``add_inputs=False`` the rows
    between, before and after the segments are zeroed. Those rows belong to no segment and must stay
    bit-identical (docs/vllm-lora-ops.md §2.3); rows of slot −1 inside a segment are skipped correctly."""

    name = "fault-sgmv-stores-uncovered-rows"

    def sgmv_expand(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, add_inputs=False):
        super().sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                            batches, max_seq_length, token_nums, add_inputs)
        self.store_uncovered(output_tensor, b_seq_start_loc, seq_len_tensor, 0, as_3d(lora_b_weights).size(1), add_inputs)

    def sgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                          batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
        super().sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                  lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs)
        self.store_uncovered(output_tensor, b_seq_start_loc, seq_len_tensor, slice_offset, slice_size, add_inputs)

    def store_uncovered(self, out, b_seq_start_loc, seq_len_tensor, offset: int, width: int, add_inputs: bool) -> None:
        # a row is covered when some segment holds it; slot −1 segments count as covered (skipped, right)
        covered = self.slots_of_segments(b_seq_start_loc, seq_len_tensor, torch.zeros_like(seq_len_tensor), out.size(0)) != -1
        columns = slice(offset, offset + width)
        kept = out[~covered, columns].float() if add_inputs else torch.zeros_like(out[~covered, columns], dtype=torch.float32)
        out[~covered, columns] = (kept + 0.0).to(out.dtype)


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


# -- fused-MoE faults: the kernel --------------------------------------------------------------


class MoERoutedWeightInW13(PlainTorchTarget):
    """The routing weight is applied whatever ``mul_routed_weight`` says, so w13's delta is weighted too.

    The weight belongs to w2 only (vLLM passes ``mul_routed_weight=True`` there, once per pair); a kernel
    that loads ``topk_weights`` unconditionally scales the gate/up delta before the activation, and the
    token's output is weighted a second time after w2."""

    name = "fault-moe-routed-weight-in-w13"

    def pair_weights(self, topk_weights, mul_routed_weight):
        return topk_weights.reshape(-1).float()


class MoERoutedWeightTwice(PlainTorchTarget):
    """w2's delta is multiplied by the routing weight twice (``w²``): the kernel applies it and so does
    an epilogue that was written for a kernel that did not."""

    name = "fault-moe-routed-weight-twice"

    def pair_weights(self, topk_weights, mul_routed_weight):
        weights = super().pair_weights(topk_weights, mul_routed_weight)
        return None if weights is None else weights * weights


class MoEExpertOffByOne(PlainTorchTarget):
    """Each pair reads the LoRA weights of expert ``e − 1`` (expert 0 the last one, by negative indexing).

    A 1-based expert id, or the global → local translation applied with an offset of one: the delta
    of the neighbouring expert, of the right shape, so nothing raises."""

    name = "fault-moe-expert-off-by-one"

    def kernel_experts(self, experts, num_experts):
        return torch.where(experts >= 0, (experts - 1) % num_experts, experts)


class MoENoAdapterPairsServedByLastSlot(PlainTorchTarget):
    """Pairs of tokens without adapter (slot −1) get the last slot's delta: ``token_lora_mapping`` −1
    used as an index (negative indexing), in the naive kernel path and in the alignment.

    The MoE twin of vllm#48421 (the CPU torch ops' ``lora_weights[lora_indices]``)."""

    name = "fault-moe-neg1-is-last-slot"

    def resolve_pair_slots(self, slots, num_slots):
        return torch.where(slots == -1, num_slots - 1, slots)


class MoENonLocalExpertServedByExpert0(PlainTorchTarget):
    """Choices of experts on another rank (``expert_map`` −1) are sorted into local expert 0's group: the
    −1 is clamped to a valid index instead of being skipped.

    Under expert parallelism every rank then adds its expert 0's LoRA delta to pairs another rank
    serves (vLLM's CUDA op translates with ``expert_map`` and must drop the −1 ones)."""

    name = "fault-moe-nonlocal-is-expert-0"

    def align_experts(self, topk_ids, expert_map):
        return super().align_experts(topk_ids, expert_map).clamp(min=0)


class MoELastChoiceDropped(PlainTorchTarget):
    """The kernel walks only the first ``top_k − 1`` choices of each token (a ``range(top_k - 1)`` bound):
    the last choice gets no LoRA delta, and with ``top_k = 1`` nothing does."""

    name = "fault-moe-last-choice-dropped"

    def pairs_walked(self, num_pairs, top_k):
        return torch.arange(num_pairs, device=self.device) % top_k != top_k - 1


class MoEW2ReadsTokenRow(PlainTorchTarget):
    """w2 reads input row ``t`` (the token's) instead of ``t·top_k + k`` (the pair's activated
    intermediate): w13's ``pair // top_k`` indexing kept when ``mul_routed_weight`` is set."""

    name = "fault-moe-w2-reads-token-row"

    def input_rows(self, num_pairs, top_k, mul_routed_weight):
        return super().input_rows(num_pairs, top_k, False)


class MoEGateUpSwapped(PlainTorchTarget):
    """The gate and up slices land in each other's columns (``[up; gate]`` instead of vLLM's ``[gate; up]``
    order of the packed w13 output), so the activation multiplies the wrong halves."""

    name = "fault-moe-gate-up-swapped"

    def moe_slice_columns(self, num_slices, width, offset):
        return super().moe_slice_columns(num_slices, width, offset)[::-1]


class MoEAdapterEnabledIgnored(PlainTorchTarget):
    """``adapter_enabled`` is ignored: a slot whose adapter has no MoE LoRA weights (a dense-only adapter
    on an MoE model) is served from whatever its stack holds, in the kernel and in the alignment."""

    name = "fault-moe-adapter-enabled-ignored"

    def slot_enabled(self, adapter_enabled, slots, num_slots):
        return (slots >= 0) & (slots < num_slots)


class MoESharedStackStridesIgnored(PlainTorchTarget):
    """A shared stack (expanded to every expert with stride 0, as vLLM's layer passes it) is read as if
    it were packed ``[L, E, …]``: expert ``e`` of slot ``l`` is taken at matrix ``l·E + e`` of its memory.

    Pointer arithmetic that assumes contiguous weights instead of using ``stride_A_expert``; past the
    stack's real ``L`` matrices this reads zeros here (other memory on a device)."""

    name = "fault-moe-shared-strides-ignored"

    def flat_experts(self, stack):
        if stack.stride(1) != 0 or stack.size(1) == 1:
            return super().flat_experts(stack)
        num_slots, num_experts, rows, cols = stack.shape
        memory = stack[:, 0].reshape(-1)  # the L matrices the stack really holds
        packed = torch.cat([memory, memory.new_zeros(num_slots * (num_experts - 1) * rows * cols)])
        return packed.view(num_slots * num_experts, rows, cols)


# -- fused-MoE faults: the alignment -------------------------------------------------------------


class MoEAlignPadsWithZero(PlainTorchTarget):
    """Groups are padded with id 0 instead of ``T·top_k`` (a zero-filled buffer where vLLM's op fills
    with ``topk_ids.numel()``): padding aliases pair 0, which the kernel then serves with every
    block's expert."""

    name = "fault-moe-align-pads-with-zero"

    def padding_id(self, num_pairs):
        return 0


class MoEAlignFullGroupLosesLastPair(PlainTorchTarget):
    """A pair is dropped when an expert's group exactly fills its blocks: positions inside a group are
    counted from 1 and bounded by the group's padded end, which only bites when no padding is left."""

    name = "fault-moe-align-full-group-loses-pair"

    def pair_positions(self, group_start, rank_in_group, group_length):
        positions = group_start + rank_in_group + 1
        return positions, positions < group_start + group_length


class MoEAlignUnusedBlocksKeepLastExpert(PlainTorchTarget):
    """The blocks after ``num_tokens_post_pad`` get the last group's expert instead of −1 (each block's
    expert found by a search over the group ends that is not clamped past the last one).

    vLLM fills ``expert_ids`` with −1 first so that unused blocks "don't drive the LoRA Triton kernel
    into the wrong bucket"; a kernel that walks every block then serves padding with that expert."""

    name = "fault-moe-align-unused-blocks-keep-expert"

    def unused_block_expert(self, blocks):
        return int(blocks[-1]) if blocks.numel() else 0


class MoEAlignIgnoresExpertMap(PlainTorchTarget):
    """The alignment groups pairs by their global expert, ignoring ``expert_map``: under expert
    parallelism pairs of other ranks' experts are listed and local experts are mislabelled."""

    name = "fault-moe-align-ignores-expert-map"

    def align_experts(self, topk_ids, expert_map):
        return super().align_experts(topk_ids, None)


class LinearAddInputsDropped(PlainTorchTarget):
    """``add_lora_linear`` drops its ``add_inputs`` keyword and always accumulates: a wrapper that takes it
    in ``**kwargs`` as "unused" (vLLM's CPU wrapper documents its kwargs so) serves the dual-stream path
    the base output plus the delta where the LoRA output alone was asked for."""

    name = "fault-linear-add-inputs-dropped"

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, add_inputs=True, **kwargs):
        super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)


class PackedSlicesCappedAtThree(PlainTorchTarget):
    """The lora_* kernels serve at most three slices, as a kernel whose per-slice pointer table or grid
    was sized for QKV would: the fourth to seventh slices of a packed layer get no delta."""

    name = "fault-packed-slices-capped-at-three"

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, *metadata_and_scaling):
        super().lora_shrink(inputs, lora_a_weights[:3], output_tensor[:3], *metadata_and_scaling)

    def lora_expand(self, inputs, lora_b_weights, output_tensor, *metadata, **kwargs):
        super().lora_expand(inputs[:3], lora_b_weights[:3], output_tensor, *metadata, **kwargs)


# -- systematic faults: a delta a percent or two off, inside the elementwise budget -------------------


class DeltaGain(PlainTorchTarget):
    """Base of the systematic faults: while ``gained_op`` runs on ``dtype`` weights, the expand's
    float32 accumulator is multiplied by ``1 + gain``, so the LoRA delta (not the bias) is ``gain`` too
    large in every element. The bug classes: inverted dropout's ``1 / (1 − p)`` rescale left on at
    inference for a LoRA dropout ``p`` of 1–2 %; a scaling factor computed from a rounded or
    mismatched ``alpha`` or rank; a dequantisation scale slightly off. Each error is about one rounding
    of the output, so only the systematic-error rule of the verdict can see it."""

    name = "fault-delta-gain"
    gained_op = ""
    dtype = torch.bfloat16
    gain = 0.0
    _gain_applies = False

    def expand_product(self, tiled, flat_b):
        product = super().expand_product(tiled, flat_b)
        return product * (1 + self.gain) if self._gain_applies and flat_b.dtype == self.dtype else product

    def with_gain(self, op: str, *args, **kwargs):
        self._gain_applies = True
        try:
            getattr(super(), op)(*args, **kwargs)
        finally:
            self._gain_applies = False


class LinearDeltaGain(DeltaGain):
    gained_op = "add_lora_linear"

    def add_lora_linear(self, *args, **kwargs):
        self.with_gain("add_lora_linear", *args, **kwargs)


class BgmvExpandDeltaGain(DeltaGain):
    gained_op = "bgmv_expand"

    def bgmv_expand(self, *args, **kwargs):
        self.with_gain("bgmv_expand", *args, **kwargs)


class FusedMoEDeltaGain(DeltaGain):
    gained_op = "fused_moe_lora"

    def fused_moe_lora(self, *args, **kwargs):
        self.with_gain("fused_moe_lora", *args, **kwargs)


DTYPE_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def delta_gain_fault(base: type[DeltaGain], dtype: torch.dtype, gain: float) -> type[DeltaGain]:
    """The fault of ``base`` in ``dtype`` with ``gain``: its own class, name and one-line docstring."""
    percent = f"{gain * 100:+g}%"
    short = DTYPE_SHORT[dtype]
    return type(
        f"{base.__name__}_{short}_{'plus' if gain > 0 else 'minus'}{abs(gain) * 100:g}pct".replace(".", "_"),
        (base,),
        {
            "name": f"fault-delta-gain{percent.rstrip('%')}pct-{base.gained_op}-{short}",
            "dtype": dtype,
            "gain": gain,
            "__doc__": f"{base.gained_op}'s LoRA delta is {percent} off in {short} (see DeltaGain).\n\n{DeltaGain.__doc__}",
            "__module__": __name__,
        },
    )


DELTA_GAIN_FAULTS: tuple[type[DeltaGain], ...] = (
    *(delta_gain_fault(LinearDeltaGain, dtype, gain) for dtype in DTYPE_SHORT for gain in (0.01, 0.02)),
    delta_gain_fault(LinearDeltaGain, torch.bfloat16, 0.016),  # issue 14's: budget ratio 0.58, SQNR 38.8 dB
    delta_gain_fault(LinearDeltaGain, torch.bfloat16, -0.01),
    *(delta_gain_fault(BgmvExpandDeltaGain, dtype, 0.01) for dtype in DTYPE_SHORT),
    *(delta_gain_fault(FusedMoEDeltaGain, dtype, 0.01) for dtype in DTYPE_SHORT),
)
"""Systematic errors of 1–2 % in the delta, one op and one dtype each: the smoke profile must catch every one."""


class LinearScaleRoundedToDtype(LinearDeltaGain):
    """Base of the sub-ulp systematic faults: ``add_lora_linear``'s LoRA scale rounded to the activation
    dtype before use (a kernel that takes ``scale`` as a ``bf16``/``fp16`` argument, or multiplies it
    into a tensor of that dtype first). ``alpha / r = 4/3`` (alpha 16 and rank 12, 32 and 24; also 1/3,
    2/3, 8/3) rounds to exactly ``(1 + 2⁻⁹) · 4/3`` in bfloat16 and ``(1 − 2⁻¹²) · 4/3`` in float16:
    half a unit roundoff of the dtype, in every element. The fault applies the gain of 4/3 rounded
    whatever the case's scale (``DeltaGain``: the expand's float32 accumulator, not the LoRA bias), so
    it shows on every case of its op, also those whose drawn scale the dtype holds;
    ``ScaleRoundedToInputDtype`` rounds the case's own scale. Each element is off by half an ulp of its delta at most, inside the budget; the
    systematic-error rule sees it where the case has enough rows to average the per-row rounding of
    the intermediate out (docs/verdict.md, rule 4)."""


def scale_rounded_fault(dtype: torch.dtype, gain: float) -> type[LinearScaleRoundedToDtype]:
    short = DTYPE_SHORT[dtype]
    return type(
        f"LinearScaleRoundedTo_{short}",
        (LinearScaleRoundedToDtype,),
        {
            "name": f"fault-scale-rounded-to-{short}-add_lora_linear-{short}",
            "dtype": dtype,
            "gain": gain,
            "__doc__": (f"add_lora_linear's scale 4/3 rounded to {short}: the LoRA delta {gain:+.4%} off "
                        f"(see LinearScaleRoundedToDtype).\n\n{LinearScaleRoundedToDtype.__doc__}"),
            "__module__": __name__,
        },
    )


SUB_ULP_GAIN_FAULTS: tuple[type[LinearScaleRoundedToDtype], ...] = (
    scale_rounded_fault(torch.bfloat16, 2**-9),  # 4/3 → 1.3359375
    scale_rounded_fault(torch.float16, -(2**-12)),  # 4/3 → 1.3330078
)
"""Systematic errors of half a unit roundoff in the delta (a scale rounded to the dtype): the rule of
docs/verdict.md catches them from about 150 rows on, in the smoke profile its ``large_t`` and
``long_batch`` cases of ``add_lora_linear`` (all ten of the standard profile's); fewer rows cannot tell
them from the rounding of a rank-1 intermediate. In ``FAULTS``: the smoke profile catches them."""


# -- the fp8 ops: the operands' formats and scales -------------------------------------------------------


class Fp8ScaledAfterSumTarget(PlainTorchTarget):
    """Correct, and the fp8 ops computed in vLLM's kernels' order: the raw codes multiplied (a product of two
    e4m3fn codes has at most 8 significant bits, exact in bfloat16 and float32) and summed in float32 over a
    K-block, each block's sum multiplied by its ``a_scale · b_scale`` (that product taken in float32), the
    blocks added in float32. Per tensor and per channel the block is all of K (one scaling after the whole
    sum), block-wise it is ``group_k``. This is how a 16-bit matmul engine computes the op right: the codes
    go in exactly, the float32 scales multiply its float32 result (docs/verdict.md, *fp8 ops*)."""

    name = "plain-torch-fp8-scaled-after-sum"

    def lora_shrink_fp8(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling,
                        b_scale, a_scale=None, group_k=0, group_n=0, use_fp8_w8a8=False, per_channel_quant=False):
        meta = (token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
        if not use_fp8_w8a8 or bool(no_lora_flag_cpu.item()):
            return super().lora_shrink_fp8(inputs, lora_a_weights, output_tensor, token_lora_mapping, *meta, no_lora_flag_cpu,
                                           num_active_loras, scaling, b_scale, a_scale, group_k, group_n, use_fp8_w8a8,
                                           per_channel_quant)
        slots = self.fp8_slots(self.slots_of_kernel_meta(*meta, inputs.size(0)))
        for s, (lora_a, scale) in enumerate(zip(lora_a_weights, b_scale)):
            lora_a = as_3d(lora_a)
            product = self.scaled_after_sum(inputs, a_scale, lora_a, scale, slots, group_k, group_n, per_channel_quant)
            rows = slots != -1
            output_tensor[s, rows, : lora_a.size(1)] += scaling * product[rows]

    def lora_expand_fp8(self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, b_scale,
                        a_scale=None, offset_start=0, add_inputs=False, group_k=0, group_n=0, use_fp8_w8a8=False,
                        per_channel_quant=False):
        meta = (token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
        if not use_fp8_w8a8 or bool(no_lora_flag_cpu.item()):
            return super().lora_expand_fp8(inputs, lora_b_weights, output_tensor, token_lora_mapping, *meta, no_lora_flag_cpu,
                                           num_active_loras, b_scale, a_scale, offset_start, add_inputs, group_k, group_n,
                                           use_fp8_w8a8, per_channel_quant)
        slots = self.fp8_slots(self.slots_of_kernel_meta(*meta, inputs.size(1)))
        rows = slots != -1
        stacks = [as_3d(b) for b in lora_b_weights]
        for s, (lora_b, offset) in enumerate(zip(stacks, self.slice_offsets([b.size(1) for b in stacks], offset_start))):
            product = self.scaled_after_sum(inputs[s], a_scale, lora_b, b_scale[s], slots, group_k, group_n, per_channel_quant)
            delta = product[rows].to(output_tensor.dtype)  # rounded to the output dtype before the add, as the kernel does
            columns = slice(offset, offset + lora_b.size(1))
            if add_inputs:
                output_tensor[rows, columns] += delta
            else:
                output_tensor[rows, columns] = delta

    def scaled_after_sum(self, x_codes, a_scale, w_codes, b_scale, slots, group_k: int, group_n: int, per_channel: bool):
        """``[T, N]`` float32: ``Σ_blocks (Σ_{k in block} x_q[t, k] · W_q[l, n, k]) · (sx · sw)`` for each row ``t``
        of slot ``l`` (0 for rows without adapter). The scales per K-block: the activation's ``[T, KB]``, the
        weight's ``[L, N, KB]`` (``KB`` = 1 but for block scales)."""
        (rows, k), (num_slots, n, _) = x_codes.shape, w_codes.shape
        if group_k > 0 and group_n > 0:
            block = group_k
            x_scale = a_scale.float().reshape(rows, -1)
            w_scale = b_scale.float().reshape(num_slots, -1, x_scale.size(1)).repeat_interleave(group_n, dim=1)[:, :n]
        else:
            block = k
            x_scale = a_scale.float().reshape(rows, 1) if per_channel else a_scale.float().reshape(-1)[:1].expand(rows, 1)
            w_scale = b_scale.float().reshape(num_slots, n if per_channel else 1, 1).expand(num_slots, n, 1)
        x, w = x_codes.float(), w_codes.float()  # exact: every e4m3fn code is a float32 number
        result = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
        for slot in slots[slots != -1].unique().tolist():
            mine = slots == slot
            for b, start in enumerate(range(0, k, block)):
                partial = x[mine, start : start + block] @ w[slot, :, start : start + block].T  # float32 sum of exact products
                result[mine] += partial * (x_scale[mine, b : b + 1] * w_scale[slot, :, b])
        return result


class Fp8SaturatesAtGaudi2Range(PlainTorchTarget):
    """fp8 codes clamped to ±240: Gaudi 2's e4m3 (IEEE-like, with infinities and NaNs) has a largest finite value
    of 240, OCP e4m3fn's is 448; a port that converts e4m3fn codes through Gaudi 2's format (or quantizes with
    its range) loses every code in (240, 448]."""

    name = "fault-fp8-saturates-at-240"

    def fp8_values(self, codes):
        return codes.float().clamp(-240.0, 240.0)


class Fp8ReadAsE5M2(PlainTorchTarget):
    """e4m3fn bits read as e5m2: the other fp8 format (vLLM's multi-slice kernels cast every fp8 weight pointer
    to one format whatever the tensor's dtype; a device kernel picked for the wrong format does the same)."""

    name = "fault-fp8-read-as-e5m2"

    def fp8_values(self, codes):
        return codes.view(torch.float8_e5m2).float()


class Fp8WeightScaleIgnored(PlainTorchTarget):
    """The weight scale never applied: the fp8 LoRA weights used as their raw codes (a port that takes the fp8
    weights for bf16 ones, or drops ``b_scale`` on the way to a fused kernel)."""

    name = "fault-fp8-weight-scale-ignored"

    def weight_scale_of(self, b_scale, mode, shape, group_k, group_n):
        return torch.ones((), device=b_scale.device)


class Fp8WeightScaleAppliedTwice(PlainTorchTarget):
    """The weight scale applied twice: once when the weights are dequantized and again after the accumulation
    (vLLM's kernel applies tensor and channel scales after the sum: a port that also dequantizes first)."""

    name = "fault-fp8-weight-scale-applied-twice"

    def weight_scale_of(self, b_scale, mode, shape, group_k, group_n):
        return super().weight_scale_of(b_scale, mode, shape, group_k, group_n) ** 2


class Fp8ChannelScaleAlongK(PlainTorchTarget):
    """The per-output-channel weight scale applied along the contraction: element ``[l, n, k]`` scaled by
    ``b_scale[l, k mod N]`` (the scale pointer walked with the K offsets instead of the output columns')."""

    name = "fault-fp8-channel-scale-along-k"

    def weight_scale_of(self, b_scale, mode, shape, group_k, group_n):
        if mode != "channel":
            return super().weight_scale_of(b_scale, mode, shape, group_k, group_n)
        slots, n, k = shape
        return b_scale.reshape(slots, n)[:, torch.arange(k, device=b_scale.device) % n][:, None, :]


class Fp8TokenScaleAlongN(PlainTorchTarget):
    """The per-token activation scale applied along the output features: output column ``n`` scaled by
    ``a_scale[n mod T]`` instead of row ``t`` by ``a_scale[t]`` (a scale vector broadcast on the wrong axis)."""

    name = "fault-fp8-token-scale-along-n"

    def fp8_operands(self, codes, a_scale, stacks, b_scales, quant):
        x, weights = super().fp8_operands(codes, a_scale, stacks, b_scales, quant)
        if quant is None or quant[2] is False or (quant[0] > 0 and quant[1] > 0):
            return x, weights
        token_scale = a_scale.float().reshape(-1)
        x = self.fp8_values(codes)  # unscaled rows; the token scales go onto the output features instead
        along_n = [w * token_scale[torch.arange(w.size(1), device=w.device) % token_scale.numel()][None, :, None] for w in weights]
        return x, along_n


class Fp8BlockScalePerTwoGroups(PlainTorchTarget):
    """One block scale per two K-groups: the scale read once per tile of ``2 · group_k`` elements, at the tile's
    start (vLLM's Triton kernel loads one scale per ``BLOCK_K`` tile: a ``BLOCK_K`` above ``group_k`` does this)."""

    name = "fault-fp8-block-scale-per-two-groups"

    def scale_block(self, size, group, device):
        return torch.arange(size, device=device) // (2 * group) * 2


class Fp8NoAdapterRowsComputed(PlainTorchTarget):
    """Rows of slot −1 computed with slot 0 and written: a kernel that does not exit on ``lora_id == −1``."""

    name = "fault-fp8-no-adapter-rows-computed"

    def fp8_slots(self, slots):
        return slots.clamp(min=0)


class Fp8DequantizedInBf16(PlainTorchTarget):
    """Each operand dequantized into bfloat16 before a float32-accumulating matmul: ``code · scale`` rounded to
    8 significant bits, what a port that feeds a 16-bit matmul engine dequantized inputs does. A float32
    scale makes ``code · scale`` a 28-bit number, so this rounds every value by up to 2⁻⁹ (a second
    quantization the op does not have); the engine takes the codes exactly and applies the scales after the
    sum instead (``Fp8ScaledAfterSumTarget``; docs/verdict.md, *fp8 ops*)."""

    name = "fault-fp8-dequantized-in-bf16"

    def fp8_operands(self, codes, a_scale, stacks, b_scales, quant):
        x, weights = super().fp8_operands(codes, a_scale, stacks, b_scales, quant)
        return x.to(torch.bfloat16).float(), [w.to(torch.bfloat16).float() for w in weights]


class Fp8ScaleRoundedToBf16(PlainTorchTarget):
    """The weight scale rounded to bfloat16 before use: ``b_scale`` stored or cast in the model dtype (a checkpoint
    loader that converts every tensor of the layer, scales included). Each slot's, channel's or block's delta
    gets the gain ``bf16(s) / s``, up to 1 ± 2⁻⁹: a systematic error where one scale serves the case's rows."""

    name = "fault-fp8-scale-rounded-to-bf16"

    def weight_scale_of(self, b_scale, mode, shape, group_k, group_n):
        return super().weight_scale_of(b_scale.to(torch.bfloat16).float(), mode, shape, group_k, group_n)


class Fp8ScaleReciprocal(PlainTorchTarget):
    """The weight scale applied as its reciprocal: ``code / s`` instead of ``code · s`` (a port to an API whose fp8
    GEMM takes the quantization scale, ``1/s``, where vLLM passes the dequantization scale ``s``)."""

    name = "fault-fp8-scale-reciprocal"

    def weight_scale_of(self, b_scale, mode, shape, group_k, group_n):
        return 1.0 / super().weight_scale_of(b_scale, mode, shape, group_k, group_n)


class Fp8ReadAsFnuzWithoutNegativeZeroFix(PlainTorchTarget):
    """e4m3fn codes reinterpreted as e4m3fnuz (AMD's fp8 before MI350) with the scale doubled, as vLLM's ROCm path
    normalizes fp8 weights (``normalize_e4m3fn_to_e4m3fnuz``), but without its fix of 0x80: e4m3fn's −0 is fnuz's
    NaN. Every other code reads as half its value (fnuz's exponent bias is 8, not 7), which the doubled scale
    restores exactly, so only a −0 code the op reads shows it (fp8_values places one in every operand)."""

    name = "fault-fp8-fnuz-negative-zero-nan"

    def fp8_values(self, codes):
        return codes.view(torch.float8_e4m3fnuz).float() * 2.0  # the doubled scale, applied to the values


class Fp8ExpandPartialRankGroupClamped(PlainTorchTarget):
    """lora_expand_fp8's block scales along the rank (its K) looked up among ``⌊R / group_k⌋`` groups instead of
    ``⌈R / group_k⌉``, the group index clamped into them: the ranks of a partial last group read the scale of
    the group before it (index ``⌈R / group_k⌉ − 2``), in ``a_scale`` and ``b_scale``. A port that sizes the
    rank's scale grid by floor division, as if every rank were a multiple of ``group_k`` (power-of-two ranks
    from 32 with groups of 16–32 are): only a rank that is no multiple of ``group_k`` shows it."""

    name = "fault-fp8-expand-partial-rank-group-clamped"

    def lora_expand_fp8(self, *args, **kwargs):
        call = inspect.signature(super().lora_expand_fp8).bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        rank, group_k, group_n = given["inputs"].size(-1), given["group_k"], given["group_n"]
        if given["use_fp8_w8a8"] and group_k > 0 and group_n > 0 and rank % group_k and rank > group_k:
            given["a_scale"] = self.last_group_reads_the_one_before(given["a_scale"])
            given["b_scale"] = [self.last_group_reads_the_one_before(s) for s in given["b_scale"]]
        return super().lora_expand_fp8(*call.args, **call.kwargs)

    @staticmethod
    def last_group_reads_the_one_before(scale: torch.Tensor) -> torch.Tensor:
        """A copy of the ``[…, ⌈R/group_k⌉]`` scales whose last K-group holds the one before it (the inputs stay)."""
        clamped = scale.clone()
        clamped[..., -1] = scale[..., -2]
        return clamped


FP8_FAULTS: tuple[type[PlainTorchTarget], ...] = (
    Fp8SaturatesAtGaudi2Range,
    Fp8ReadAsE5M2,
    Fp8WeightScaleIgnored,
    Fp8WeightScaleAppliedTwice,
    Fp8ChannelScaleAlongK,
    Fp8TokenScaleAlongN,
    Fp8BlockScalePerTwoGroups,
    Fp8NoAdapterRowsComputed,
    Fp8DequantizedInBf16,
    Fp8ScaleRoundedToBf16,
    Fp8ScaleReciprocal,
    Fp8ReadAsFnuzWithoutNegativeZeroFix,
    Fp8ExpandPartialRankGroupClamped,
)
"""The fp8 ops' faults: each changes only lora_shrink_fp8 / lora_expand_fp8, so only their cases can catch it."""


class MoEFp8ScaleOfExpertZero(PlainTorchTarget):
    """fused_moe_lora_fp8 with every expert's weight scales read from expert 0: the scale pointer advanced by
    the slot's stride only (a port that takes the dense ops' per-slot scale layout for the MoE stacks)."""

    name = "fault-moe-fp8-scale-of-expert-0"

    def expert_slot_scales(self, scales, quant):
        if quant is None:
            return scales
        return super().expert_slot_scales([s[:, :1].expand_as(s) for s in scales], quant)


class MoEFp8IntermediateRequantized(PlainTorchTarget):
    """The shrink result re-quantized to e4m3fn (one amax/448 scale per pair) before the expand, as a port that
    runs both halves as fp8 GEMMs does: vLLM's op keeps the intermediate in the output dtype. 3 significant
    bits instead of 8 or 11; the 16-bit fused_moe_lora would be changed the same way."""

    name = "fault-moe-fp8-intermediate-requantized"

    def round_intermediate(self, shrunk, out_dtype):
        scale = (shrunk.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (shrunk / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return (codes.float() * scale).to(out_dtype)


class MoEFp8PairScaleReadPerToken(PlainTorchTarget):
    """fused_moe_lora_fp8 with the routing weight (w2: an input row and a per-channel activation scale per pair)
    reading pair ``p``'s scale from row ``p // top_k``, its token's: vLLM's dense fused_moe kernel indexes the
    activation scales by ``offs_token // top_k`` (its input has a row per token); a port that keeps that index for
    the scales where the input rows are the pairs' scales all but the first ``T`` pairs by another pair's scale.
    With top_k 1 the two indices agree: only a per-channel w2 case with two choices or more can see it."""

    name = "fault-moe-fp8-pair-scale-read-per-token"

    def fused_moe_lora_fp8(self, *args, **kwargs):
        call = inspect.signature(super().fused_moe_lora_fp8).bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        scale = given["shrink_act_scale"]
        if given["mul_routed_weight"] and given["per_channel_quant"] and scale is not None:
            rows = torch.arange(scale.size(0), device=scale.device)
            given["shrink_act_scale"] = scale[rows // given["top_k_num"]]  # a new tensor: the input stays as it was
        return super().fused_moe_lora_fp8(*call.args, **call.kwargs)


MOE_FP8_FAULTS: tuple[type[PlainTorchTarget], ...] = (MoEFp8ScaleOfExpertZero, MoEFp8IntermediateRequantized, MoEFp8PairScaleReadPerToken)
"""fused_moe_lora_fp8's own faults (the dense fp8 faults above reach it too, through the same helpers)."""


# -- vLLM 0.33's token classification head: add_shrink of the whole head, then the pick -------------------


class HeadLabelsTruncatedTo16(PlainTorchTarget):
    """The head's label columns cut to a multiple of 16 (a shrink tiled by 16 with no tail mask, or a rank
    bucket of 16): the last ``P mod 16`` labels of a token with a saved head get its bias alone."""

    name = "fault-head-labels-truncated-to-16"

    def token_classification_head(self, y, x, weight_stacked, bias_stacked, module_enabled):
        kept = weight_stacked.size(-2) // 16 * 16
        truncated = torch.zeros_like(weight_stacked)
        truncated[..., :kept, :] = weight_stacked[..., :kept, :]
        super().token_classification_head(y, x, truncated, bias_stacked, module_enabled)


class HeadBiasOnRowsWithoutHead(PlainTorchTarget):
    """Tokens of an adapter without a saved head get that slot's bias added to their base output: the bias is
    added to every adapter row before the pick looks at ``full_module_enabled``."""

    name = "fault-head-bias-on-rows-without-head"

    def token_classification_head(self, y, x, weight_stacked, bias_stacked, module_enabled):
        super().token_classification_head(y, x, weight_stacked, bias_stacked, module_enabled)
        slots = self.token_indices
        no_head = (slots >= 0) & ~module_enabled.bool()[slots.clamp(min=0)]
        y2d = y.view(-1, y.size(-1))
        y2d[no_head] = (y2d[no_head].float() + bias_stacked[slots[no_head]].float()).to(y.dtype)


class HeadReplacesNoAdapterRows(PlainTorchTarget):
    """Tokens without adapter (slot −1) replaced when the last slot has a head: the pick drops ``indices >= 0``
    and reads ``full_module_enabled[-1]`` and ``bias[-1]``, the last slot's, so such a row becomes that bias."""

    name = "fault-head-replaces-no-adapter-rows"

    def token_classification_head(self, y, x, weight_stacked, bias_stacked, module_enabled):
        x = x.reshape(-1, x.size(-1))
        product = torch.zeros(1, x.size(0), weight_stacked.size(-2), dtype=torch.float32)
        self.add_shrink(product, x, (weight_stacked,), 1.0)
        slots = self.token_indices  # −1 indexes the last slot
        result = product[0] + bias_stacked[slots].float()
        y2d = y.view(-1, y.size(-1))
        y2d.copy_(torch.where(module_enabled.bool()[slots][:, None], result.to(y.dtype), y2d))


class HeadPickedByLoraId(PlainTorchTarget):
    """The pick reads ``full_module_enabled`` at the token's LoRA id (slot + 1, vLLM's 1-based id) instead of its
    slot, the last slot wrapping to the first: a token is replaced or kept by its neighbouring slot's head."""

    name = "fault-head-picked-by-lora-id"

    def token_classification_head(self, y, x, weight_stacked, bias_stacked, module_enabled):
        super().token_classification_head(y, x, weight_stacked, bias_stacked, module_enabled.roll(-1))


TOKEN_HEAD_FAULTS: tuple[type[PlainTorchTarget], ...] = (
    HeadLabelsTruncatedTo16,
    HeadBiasOnRowsWithoutHead,
    HeadReplacesNoAdapterRows,
    HeadPickedByLoraId,
)
"""The token head's faults: each changes only token_classification_head, so only its cases can catch it."""


# -- vLLM 0.34: its layer ops (conformance.targets.vllm034_layers), packed adapters, speculative-decoding logits --


class GroupedFirstGroupLoRAB(PlainTorchTarget):
    """Every head group of DeepSeek-V4's grouped ``wo_a`` gets group 0's LoRA-B: a port that keeps one LoRA-B
    buffer for the layer (as for any column-parallel layer) instead of vLLM 0.34's one per group."""

    name = "fault-grouped-first-group-lora-b"

    def grouped_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale):
        super().grouped_lora_linear(y, x, lora_a_stacked, (lora_b_stacked[0],) * len(lora_b_stacked), scale)


class EmbedScaleAppliedTwice(PlainTorchTarget):
    """``embed_scale`` folded into LoRA-B when the adapter is set and applied again in the forward (a port of the
    scaled embedding that scales the lookup plus LoRA output as HF's forward scales the lookup)."""

    name = "fault-embed-scale-applied-twice"

    def scaled_embedding_lora(self, y, x, lora_b_stacked, embed_scale, add_inputs=True):
        super().scaled_embedding_lora(y, x, lora_b_stacked, None if embed_scale is None else embed_scale**2, add_inputs)


class EmbedScaleNotFolded(PlainTorchTarget):
    """``embed_scale`` never folded into LoRA-B: vLLM 0.33's ``set_lora``, which PEFT's scaled delta outgrew."""

    name = "fault-embed-scale-not-folded"

    def scaled_embedding_lora(self, y, x, lora_b_stacked, embed_scale, add_inputs=True):
        super().scaled_embedding_lora(y, x, lora_b_stacked, None, add_inputs)


class PackedSlicesStopAtAbsent(PlainTorchTarget):
    """A slot's packed slices after the first one its adapter lacks are served as absent too: a port that walks an
    adapter's packed groups and stops at the first None (vLLM 0.33's ``expand_packed_lora`` handled a None only
    as the last group; 0.34 aligns the groups after it from the back)."""

    name = "fault-packed-slices-stop-at-absent"

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs):
        lora_b_stacked = [b.clone() for b in lora_b_stacked]
        for slot in range(lora_a_stacked[0].size(0)):
            lacking = [not (a[slot].any() or b[slot].any()) for a, b in zip(lora_a_stacked, lora_b_stacked)]
            if True in lacking:
                for b in lora_b_stacked[lacking.index(True):]:
                    b[slot] = 0
        return super().add_lora_linear(y, x, lora_a_stacked, tuple(lora_b_stacked), scale, output_slices, **kwargs)


class LogitsOneRowPerRequest(PlainTorchTarget):
    """The logits rows mapped one per request, as vLLM 0.33's model runner built ``prompt_lora_mapping`` (a request's
    adapter once): under speculative decoding the rows after the first ``num_reqs`` read no adapter, and the rows
    of a request's drafts take the next requests' adapters. With one logits row per request it is correct."""

    name = "fault-logits-one-row-per-request"

    def update_metadata(self, mapping):
        starts = [sum(mapping.seq_lens[:i]) for i in range(len(mapping.seq_lens))]
        per_request = [mapping.token_slots[start] for start in starts]
        rows = len(mapping.sampled_slots)
        sampled = tuple(per_request[:rows]) + (-1,) * max(0, rows - len(per_request))
        super().update_metadata(dataclasses.replace(mapping, sampled_slots=sampled))


V034_FAULTS: tuple[type[PlainTorchTarget], ...] = (
    GroupedFirstGroupLoRAB, EmbedScaleAppliedTwice, EmbedScaleNotFolded, PackedSlicesStopAtAbsent, LogitsOneRowPerRequest,
)
"""vLLM 0.34's faults: each is caught only by the cases of its feature (grouped_lora_a, embed_scale, partial_packed,
spec_decode_logits)."""


# -- precision: a 16-bit output computed through a coarser format -------------------------------------


class DeltaThroughBf16(PlainTorchTarget):
    """Base of the precision faults: while ``rounded_op`` runs with a float16 output, the expand's delta
    passes through bfloat16 before it is added (8 significant bits instead of float16's 11). The bug
    class: a port that hard-codes bfloat16 where the layer's dtype belongs (the expand's output buffer,
    the GEMM's output type of an engine or library call that returns bfloat16, a ``torch.empty(...,
    dtype=torch.bfloat16)`` left from the model it was written for). Each element is off by one
    bfloat16 rounding of its delta, a few float16 ulps, inside the budget (4 × the baseline's largest
    error) and without a bias along the delta: only the precision rule sees it (docs/verdict.md, rule 5)."""

    name = "fault-delta-through-bf16"
    rounded_op = ""
    _rounding = False

    def through_bf16(self, *args, **kwargs):
        self._rounding = True
        try:
            getattr(super(), self.rounded_op)(*args, **kwargs)
        finally:
            self._rounding = False

    def write_expand(self, out, delta, rows, offset: int, add_inputs: bool) -> None:
        if self._rounding and out.dtype == torch.float16:
            delta = delta.to(torch.bfloat16)
        super().write_expand(out, delta, rows, offset, add_inputs)


class Fp8ExpandDeltaThroughBf16(DeltaThroughBf16):
    """lora_expand_fp8 with a float16 output: the delta of the fp8 GEMM rounded to bfloat16 before it is
    added (an fp8 GEMM whose output type is bfloat16 whatever the layer's dtype). See DeltaThroughBf16."""

    name = "fault-delta-through-bf16-lora_expand_fp8-fp16"
    rounded_op = "lora_expand_fp8"

    def lora_expand_fp8(self, *args, **kwargs):
        self.through_bf16(*args, **kwargs)


class LinearDeltaThroughBf16(DeltaThroughBf16):
    """add_lora_linear with a float16 output: the expand's delta rounded to bfloat16 before it is added (the
    expand's output buffer allocated in bfloat16, the dtype of the model it was ported from). See
    DeltaThroughBf16."""

    name = "fault-delta-through-bf16-add_lora_linear-fp16"
    rounded_op = "add_lora_linear"

    def add_lora_linear(self, *args, **kwargs):
        self.through_bf16(*args, **kwargs)


PRECISION_FAULTS: tuple[type[DeltaThroughBf16], ...] = (Fp8ExpandDeltaThroughBf16, LinearDeltaThroughBf16)
"""Float16 outputs carrying bfloat16's precision: inside the budget and unbiased, caught by the precision
rule alone. In ``FAULTS``: the smoke profile catches them."""


FAULTS: tuple[type[PlainTorchTarget], ...] = (
    NegativeIndexIsLastSlot,
    BaseRowsGetSlotZeroInOneLayer,
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
    SgmvIgnoresSeqStartLoc,
    SgmvStoresUncoveredRows,
    BiasOnNoAdapterRows,
    BiasScaled,
    BiasIgnoresOffsetStart,
    ScalesInputInPlace,
    LinearAddInputsDropped,
    PackedSlicesCappedAtThree,
    MoERoutedWeightInW13,
    MoERoutedWeightTwice,
    MoEExpertOffByOne,
    MoENoAdapterPairsServedByLastSlot,
    MoENonLocalExpertServedByExpert0,
    MoELastChoiceDropped,
    MoEW2ReadsTokenRow,
    MoEGateUpSwapped,
    MoEAdapterEnabledIgnored,
    MoESharedStackStridesIgnored,
    MoEAlignPadsWithZero,
    MoEAlignFullGroupLosesLastPair,
    MoEAlignUnusedBlocksKeepLastExpert,
    MoEAlignIgnoresExpertMap,
    *DELTA_GAIN_FAULTS,
    *SUB_ULP_GAIN_FAULTS,
    *FP8_FAULTS,
    *MOE_FP8_FAULTS,
    *TOKEN_HEAD_FAULTS,
    *PRECISION_FAULTS,
    *V034_FAULTS,
)
"""Faults the smoke profile must catch (at least one case ends FAIL)."""

UNCAUGHT_BY_DESIGN: dict[type[PlainTorchTarget], str] = {
    CastTypeSkipped: "more accurate than the baseline: the float64 oracle does not round the input either",
    ExpandLowPrecisionAccumulation: "K = rank ≤ 64 gives at most a few bf16 roundings, inside k × the baseline error",
}
"""Genuine deviations the smoke profile cannot flag today, and why (strict xfails in test_fault_catalog.py)."""
