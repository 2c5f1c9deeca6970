"""vLLM's kernel-level LoRA ops on the HPU engine (signatures as ``conformance/reference/op_*.py``).

Gaudi itself has no bgmv/sgmv/lora_* kernels; its wrapper goes straight to the mask math. These ops
exist so that the same implementation can be judged at the kernel level too. Each turns its
metadata into one slot per row *on the device* (``rows``), pads to the bucket and runs the same engine
steps as the wrapper:

* ``bgmv_*``: the per-token slot tensor as is;
* ``sgmv_*``: segments → slots by a membership matrix (``slots_from_segments``);
* ``lora_shrink`` / ``lora_expand``: the token-sorted ``LoRAKernelMeta`` → slots
  (``slots_from_sorted_metadata``), reading the segments, not ``token_lora_mapping``, as the kernels do;
  ``no_lora_flag_cpu`` (a CPU tensor by contract) skips the call on the host;
* ``lora_shrink_fp8`` / ``lora_expand_fp8``: the same rows, fp8 codes and their scales (``fp8``); the
  shrink writes the rows of an adapter only, as ``lora_shrink`` does (vLLM's zeroes the whole buffer first);
* ``fused_moe_lora_fp8``: the codes dequantized to float32 per (slot, expert) (``fp8.moe_operands``), then
  ``fused_moe_lora``'s routing and engine steps; it always adds, as vLLM's does.

Shrink ops add into the caller's zeroed float32 buffer; expand ops honour ``add_inputs`` and never touch
rows of slot −1 or columns outside their slice. Defaults are vLLM's (bgmv ``add_inputs=True``, sgmv and
``lora_expand`` ``False``).
"""

from __future__ import annotations

import torch

from .engine import LoRAEngine
from .fp8 import Fp8Steps, Quant, check_scales, moe_operands
from .moe_align import align_block_size
from .rows import RoutedPairs, enabled_slots, pairs_from_aligned_metadata, slots_from_segments, slots_from_sorted_metadata
from .stacks import as_3d


class HpuKernelOps:
    """Mixin: the kernel ops over ``self.engine``."""

    engine: LoRAEngine

    # -- bgmv: one slot per token ------------------------------------------------------------

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0) -> None:
        rows = self._token_rows(lora_indices_tensor, inputs)
        self.engine.shrink_into(output_tensor, inputs, lora_a_weights, rows, scaling)
        self.engine.layer.after_op()

    def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True) -> None:
        rows = self._token_rows(lora_indices_tensor, inputs)
        self.engine.expand_into(output_tensor, inputs, lora_b_weights, rows, 0, add_inputs)
        self.engine.layer.after_op()

    def bgmv_expand_slice(
        self, inputs, lora_b_weights, output_tensor, lora_indices_tensor,
        slice_offset: int, slice_size: int, add_inputs: bool = True,
    ) -> None:
        _check_slice_size(lora_b_weights, slice_size)
        rows = self._token_rows(lora_indices_tensor, inputs)
        self.engine.expand_into(output_tensor, inputs, lora_b_weights, rows, slice_offset, add_inputs)
        self.engine.layer.after_op()

    # -- sgmv: one slot per segment ----------------------------------------------------------

    def sgmv_shrink(
        self, inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
        batches: int, max_seq_length: int, token_nums: int, scaling: float,
    ) -> None:
        rows = self._segment_rows(inputs, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches, token_nums)
        self.engine.shrink_into(output_tensor, inputs, lora_a_weights, rows, scaling)
        self.engine.layer.after_op()

    def sgmv_expand(
        self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
        batches: int, max_seq_length: int, token_nums: int, add_inputs: bool = False,
    ) -> None:
        rows = self._segment_rows(inputs, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches, token_nums)
        self.engine.expand_into(output_tensor, inputs, lora_b_weights, rows, 0, add_inputs)
        self.engine.layer.after_op()

    def sgmv_expand_slice(
        self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
        batches: int, max_seq_length: int, token_nums: int, slice_offset: int, slice_size: int, add_inputs: bool = False,
    ) -> None:
        _check_slice_size(lora_b_weights, slice_size)
        rows = self._segment_rows(inputs, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches, token_nums)
        self.engine.expand_into(output_tensor, inputs, lora_b_weights, rows, slice_offset, add_inputs)
        self.engine.layer.after_op()

    # -- lora_*: token-sorted metadata, all slices in one call -------------------------------

    def lora_shrink(
        self, inputs, lora_a_weights: list[torch.Tensor], output_tensor, token_lora_mapping,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
        no_lora_flag_cpu, scaling: float,
    ) -> None:
        if bool(no_lora_flag_cpu.item()):
            return
        if output_tensor.size(0) != len(lora_a_weights):
            raise ValueError(f"output has {output_tensor.size(0)} slices but {len(lora_a_weights)} LoRA-A stacks were given")
        meta = (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
        rows = self._sorted_rows(inputs.size(0), *meta)
        for s, lora_a in enumerate(lora_a_weights):
            self.engine.shrink_into(output_tensor[s], inputs, lora_a, rows, scaling)
        self.engine.layer.after_op()

    def lora_expand(
        self, inputs, lora_b_weights: list[torch.Tensor], output_tensor, token_lora_mapping,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
        no_lora_flag_cpu, offset_start: int = 0, add_inputs: bool = False,
    ) -> None:
        if bool(no_lora_flag_cpu.item()):
            return
        if inputs.size(0) != len(lora_b_weights):
            raise ValueError(f"inputs have {inputs.size(0)} slices but {len(lora_b_weights)} LoRA-B stacks were given")
        meta = (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
        rows = self._sorted_rows(inputs.size(1), *meta)
        column = offset_start
        for s, lora_b in enumerate(lora_b_weights):
            self.engine.expand_into(output_tensor, inputs[s], lora_b, rows, column, add_inputs)
            column += as_3d(lora_b).size(1)
        self.engine.layer.after_op()

    # -- lora_*_fp8: the same metadata, fp8 codes with their scales (``fp8``) ------------------

    def lora_shrink_fp8(
        self, inputs, lora_a_weights: list[torch.Tensor], output_tensor, token_lora_mapping,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
        no_lora_flag_cpu, num_active_loras, scaling: float, b_scale: list[torch.Tensor], a_scale=None,
        group_k: int = 0, group_n: int = 0, use_fp8_w8a8: bool = False, per_channel_quant: bool = False,
    ) -> None:
        """vLLM's argument order; ``num_active_loras`` only sizes the Triton grid and is not read."""
        if bool(no_lora_flag_cpu.item()):
            return
        if output_tensor.size(0) != len(lora_a_weights):
            raise ValueError(f"output has {output_tensor.size(0)} slices but {len(lora_a_weights)} LoRA-A stacks were given")
        quant = Quant.of(use_fp8_w8a8, per_channel_quant, group_k, group_n)
        check_scales("lora_shrink_fp8", quant, lora_a_weights, b_scale, a_scale)
        meta = (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
        rows = self._sorted_rows(inputs.size(0), *meta)
        # vLLM's op zeroes the whole buffer first; like this target's lora_shrink, this one writes only the rows of an
        # adapter (the suite's contract: rows of slot −1 and columns past the rank are left as given, a zeroed buffer)
        for s, lora_a in enumerate(lora_a_weights):
            scales = b_scale[s] if quant.granularity != "none" else None
            self._fp8_steps().shrink(output_tensor[s], inputs, lora_a, scales, a_scale, rows, scaling, quant)
        self.engine.layer.after_op()

    def lora_expand_fp8(
        self, inputs, lora_b_weights: list[torch.Tensor], output_tensor, token_lora_mapping,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
        no_lora_flag_cpu, num_active_loras, b_scale: list[torch.Tensor], a_scale=None, offset_start: int = 0,
        add_inputs: bool = False, group_k: int = 0, group_n: int = 0, use_fp8_w8a8: bool = False,
        per_channel_quant: bool = False,
    ) -> None:
        """vLLM's argument order; one ``a_scale`` serves every slice (the kernel has no slice stride for it)."""
        if bool(no_lora_flag_cpu.item()):
            return
        if inputs.size(0) != len(lora_b_weights):
            raise ValueError(f"inputs have {inputs.size(0)} slices but {len(lora_b_weights)} LoRA-B stacks were given")
        quant = Quant.of(use_fp8_w8a8, per_channel_quant, group_k, group_n)
        check_scales("lora_expand_fp8", quant, lora_b_weights, b_scale, a_scale)
        meta = (token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
        rows = self._sorted_rows(inputs.size(1), *meta)
        column = offset_start
        for s, lora_b in enumerate(lora_b_weights):
            scales = b_scale[s] if quant.granularity != "none" else None
            self._fp8_steps().expand(output_tensor, inputs[s], lora_b, scales, a_scale, rows, column, add_inputs, quant)
            column += as_3d(lora_b).size(1)
        self.engine.layer.after_op()

    def _fp8_steps(self) -> Fp8Steps:
        """Made on first use, once per target: its prepared (compiled, captured) core functions persist."""
        steps = getattr(self, "_fp8", None)
        if steps is None or steps.engine is not self.engine:
            steps = self._fp8 = Fp8Steps(self.engine)
        return steps

    # -- the fused-MoE kernels -----------------------------------------------------------------

    def fused_moe_lora(
        self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
        num_tokens_post_padded, token_lora_mapping, max_lora_rank: int, top_k_num: int, lora_ids, num_active_loras,
        adapter_enabled, shrink_block_size_m: int, *tiles, mul_routed_weight: bool = False, fully_sharded: bool = False,
        offset: int = 0, add_inputs: bool = True,
    ) -> None:
        """vLLM's Triton op: Triton's tile parameters are read for the block size only (``shrink_block_size_m``);
        vLLM passes ``mul_routed_weight``, ``fully_sharded``, ``offset``, ``add_inputs`` positionally after them."""
        if len(tiles) not in (13, 17):
            raise ValueError(f"fused_moe_lora takes 14 tile parameters, got {len(tiles) + 1}")
        if len(tiles) == 17:  # the four trailing flags given positionally, as vLLM's wrapper does
            *tiles, mul_routed_weight, fully_sharded, offset, add_inputs = tiles
        num_tokens, top_k = topk_weights.shape
        if top_k != top_k_num or tuple(output.shape[:2]) != (num_tokens, top_k):
            raise ValueError(f"output {tuple(output.shape)} and topk_weights {tuple(topk_weights.shape)} disagree with top_k_num {top_k_num}")
        num_slots, num_pairs = lora_a_stacked[0].size(0), num_tokens * top_k
        if sorted_token_ids is None:  # naive: one expert per pair, the slot of its token
            slots = enabled_slots(token_lora_mapping.long().repeat_interleave(top_k), adapter_enabled, num_slots)
            experts = expert_ids.reshape(-1).long()
        else:
            slots, experts = pairs_from_aligned_metadata(sorted_token_ids, expert_ids, num_tokens_post_padded, lora_ids,
                                                         adapter_enabled, shrink_block_size_m, num_pairs)
        pairs = RoutedPairs.padded_to(slots, experts, num_pairs, self.engine.buckets.bucket(num_tokens) * top_k)
        weights = topk_weights.reshape(-1) if mul_routed_weight else None
        self.engine.moe_into(output.view(num_pairs, -1), qcurr_hidden_states, tuple(lora_a_stacked), tuple(lora_b_stacked),
                             pairs, top_k, offset, add_inputs, weights)
        self.engine.layer.after_op()

    def fused_moe_lora_fp8(
        self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
        num_tokens_post_padded, token_lora_mapping, max_lora_rank: int, top_k_num: int, lora_ids, num_active_loras,
        adapter_enabled, shrink_block_size_m: int, shrink_block_size_n: int, shrink_block_size_k: int,
        shrink_group_size_m: int, shrink_num_warps: int, shrink_num_stages: int, shrink_split_k: int,
        expand_block_size_m: int, expand_block_size_n: int, expand_block_size_k: int, expand_group_size_m: int,
        expand_num_warps: int, expand_num_stages: int, expand_split_k: int, lora_a_scale_stacked, lora_b_scale_stacked,
        shrink_act_scale=None, expand_act_scale=None, mul_routed_weight: bool = False, fully_sharded: bool = False,
        offset: int = 0, use_fp8_w8a8: bool = False, use_int8_w8a8: bool = False, use_int8_w8a16: bool = False,
        per_channel_quant: bool = False, block_shape=None,
    ) -> None:
        """vLLM's Triton op, ``block_shape = [group_n, group_k]``; of the tiles only ``shrink_block_size_m`` is read
        (the alignment's block). The intermediate is the output dtype's, as in ``fused_moe_lora``: there are no
        fp8 codes in it to scale, so an ``expand_act_scale`` is refused. It always adds, as vLLM's does."""
        tiles = (shrink_block_size_n, shrink_block_size_k, shrink_group_size_m, shrink_num_warps, shrink_num_stages,
                 shrink_split_k, expand_block_size_m, expand_block_size_n, expand_block_size_k, expand_group_size_m,
                 expand_num_warps, expand_num_stages, expand_split_k)
        if use_int8_w8a8 or use_int8_w8a16 or expand_act_scale is not None:
            raise ValueError("fused_moe_lora_fp8 here takes fp8 operands and no expand_act_scale")
        group_n, group_k = block_shape if block_shape is not None else (0, 0)
        quant = Quant.of(use_fp8_w8a8, per_channel_quant, group_k, group_n)
        check_scales("fused_moe_lora_fp8", quant, list(lora_a_stacked), lora_a_scale_stacked, shrink_act_scale)
        check_scales("fused_moe_lora_fp8", quant, list(lora_b_stacked), lora_b_scale_stacked, shrink_act_scale)
        x, a_stacks, b_stacks = moe_operands(qcurr_hidden_states, shrink_act_scale, lora_a_stacked, lora_a_scale_stacked,
                                             lora_b_stacked, lora_b_scale_stacked, quant, self._fp8_steps().backend.decode)
        self.fused_moe_lora(output, x, a_stacks, b_stacks, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                            token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras, adapter_enabled,
                            shrink_block_size_m, *tiles, mul_routed_weight=mul_routed_weight, fully_sharded=fully_sharded,
                            offset=offset, add_inputs=True)

    def moe_lora_align_block_size(
        self, topk_ids, token_lora_mapping, num_experts: int, block_size: int, max_loras: int, max_num_tokens_padded: int,
        max_num_m_blocks: int, sorted_token_ids, experts_ids, num_tokens_post_pad, adapter_enabled, lora_ids, expert_map=None,
    ) -> None:
        """vLLM's ``_moe_C`` op: rows of active, enabled slots written, the others left as they are."""
        sorted_rows, expert_rows, counts, written = align_block_size(
            topk_ids, token_lora_mapping, num_experts, block_size, max_loras, max_num_tokens_padded, max_num_m_blocks,
            adapter_enabled, lora_ids, expert_map,
        )
        sorted_view = sorted_token_ids.view(max_loras, max_num_tokens_padded)
        experts_view = experts_ids.view(max_loras, max_num_m_blocks)
        sorted_view.copy_(torch.where(written[:, None], sorted_rows, sorted_view))
        experts_view.copy_(torch.where(written[:, None], expert_rows, experts_view))
        num_tokens_post_pad.copy_(torch.where(written, counts, num_tokens_post_pad))
        self.engine.layer.after_op()

    # -- metadata → row state ----------------------------------------------------------------

    def _token_rows(self, lora_indices_tensor: torch.Tensor, inputs: torch.Tensor):
        if lora_indices_tensor.numel() != inputs.size(0):
            raise ValueError(f"{lora_indices_tensor.numel()} slot indices for {inputs.size(0)} tokens")
        return self.engine.rows(lora_indices_tensor)

    def _segment_rows(self, inputs, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches: int, token_nums: int):
        if inputs.size(0) != token_nums:
            raise ValueError(f"token_nums is {token_nums} but inputs have {inputs.size(0)} rows")
        per_segment = {
            "b_seq_start_loc": b_seq_start_loc, "seq_len_tensor": seq_len_tensor, "lora_indices_tensor": lora_indices_tensor
        }
        for name, tensor in per_segment.items():
            if tensor.numel() != batches:
                raise ValueError(f"{name} has {tensor.numel()} entries but batches is {batches}")
        return self.engine.rows(slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0)))

    def _sorted_rows(self, num_rows: int, token_lora_mapping, sorted_indices, counts, starts, lora_ids):
        if token_lora_mapping.numel() != num_rows:
            raise ValueError(f"token_lora_mapping has {token_lora_mapping.numel()} entries for {num_rows} tokens")
        if lora_ids.numel() != counts.numel() or starts.numel() != lora_ids.numel() + 1:
            raise ValueError(
                f"inconsistent metadata: {lora_ids.numel()} lora ids, {counts.numel()} counts, {starts.numel()} start locations"
            )
        return self.engine.rows(slots_from_sorted_metadata(sorted_indices, counts, starts, lora_ids, num_rows))


def _check_slice_size(lora_b_weights: torch.Tensor, slice_size: int) -> None:
    width = as_3d(lora_b_weights).size(1)
    if slice_size != width:
        raise ValueError(f"slice_size {slice_size} differs from the LoRA-B output width {width}")
