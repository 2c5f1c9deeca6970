"""``PlainExampleTarget``: the ten dense kernel ops (the eight 16-bit ones and the two fp8 ones), and nothing else.

Each method has the name, argument order and defaults of vLLM's op (the suite calls them so); each
works out one slot per row from its metadata and hands over to ``kernels.shrink`` / ``kernels.expand``.
The suite's ``KernelTarget`` supplies ``update_metadata`` and the five wrapper methods
(``add_shrink``, ``add_expand``, ``add_lora_linear``, ``add_lora_embedding``, ``add_lora_logits``),
composed from these kernels as vLLM's wrappers compose theirs.

A real backend replaces the bodies with calls into its own kernels and, when its tensors do not
live on the CPU, defines ``default_device`` (and ``check_available`` / ``synchronize``).
"""

from __future__ import annotations

import torch

from conformance.targets.kernel_target import KernelTarget

from . import fp8, kernels
from .kernels import as_3d


class PlainExampleTarget(KernelTarget):
    name = "plain-example"
    description = "example out-of-tree backend: the kernel ops in plain torch, wrapper methods derived by the suite"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    # Left out on purpose, to keep the example short; a MoE backend defines them like the dense kernels.
    why_not_implemented = {
        op: f"the example backend leaves the fused-MoE kernels out on purpose ({op}; see docs/moe.md for their contract)"
        for op in ("fused_moe_lora", "fused_moe_lora_fp8", "moe_lora_align_block_size")
    }

    # -- bgmv: one slot per token (decode) ---------------------------------------------------------

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        kernels.shrink(inputs, as_3d(lora_a_weights), output_tensor, lora_indices_tensor.long(), scaling)

    def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        kernels.expand(inputs, as_3d(lora_b_weights), output_tensor, lora_indices_tensor.long(), 0, add_inputs)

    def bgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        lora_b = _one_slice(as_3d(lora_b_weights), slice_size)
        kernels.expand(inputs, lora_b, output_tensor, lora_indices_tensor.long(), slice_offset, add_inputs)

    # -- sgmv: one slot per segment of rows (prefill) ------------------------------------------------

    def sgmv_shrink(self, inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, scaling):
        slots = kernels.slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
        kernels.shrink(inputs, as_3d(lora_a_weights), output_tensor, slots, scaling)

    def sgmv_expand(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, add_inputs=False):
        slots = kernels.slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
        kernels.expand(inputs, as_3d(lora_b_weights), output_tensor, slots, 0, add_inputs)

    def sgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                          lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset, slice_size,
                          add_inputs=False):
        slots = kernels.slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
        lora_b = _one_slice(as_3d(lora_b_weights), slice_size)
        kernels.expand(inputs, lora_b, output_tensor, slots, slice_offset, add_inputs)

    # -- lora_*: every slice in one call, tokens sorted by slot ----------------------------------------

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling):
        """``output_tensor[s]`` (``[S, T, R]``, float32) gets slice ``s``'s shrink."""
        if bool(no_lora_flag_cpu.item()):  # every token has slot −1: nothing to do
            return
        slots = kernels.slots_from_sorted_tokens(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                 lora_token_start_loc, lora_ids, inputs.size(0))
        for s, lora_a in enumerate(lora_a_weights):
            kernels.shrink(inputs, as_3d(lora_a), output_tensor[s], slots, scaling)

    def lora_expand(self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, offset_start=0,
                    add_inputs=False):
        """Slice ``s`` (``inputs[s]``, ``[T, R]``) lands in the columns after slices ``0 … s−1``, from ``offset_start``."""
        if bool(no_lora_flag_cpu.item()):
            return
        slots = kernels.slots_from_sorted_tokens(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                 lora_token_start_loc, lora_ids, inputs.size(1))
        column = offset_start
        for s, lora_b in enumerate(lora_b_weights):
            lora_b = as_3d(lora_b)
            kernels.expand(inputs[s], lora_b, output_tensor, slots, column, add_inputs)
            column += lora_b.size(1)

    # -- lora_*_fp8: the same metadata, fp8 codes dequantized by their scales (``fp8``) -------------------

    def lora_shrink_fp8(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling,
                        b_scale, a_scale=None, group_k=0, group_n=0, use_fp8_w8a8=False, per_channel_quant=False):
        """``lora_shrink`` on dequantized values; ``num_active_loras`` sizes vLLM's grid and is not needed here."""
        if bool(no_lora_flag_cpu.item()):
            return
        mode = fp8.granularity(use_fp8_w8a8, per_channel_quant, group_k, group_n)
        slots = kernels.slots_from_sorted_tokens(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                 lora_token_start_loc, lora_ids, inputs.size(0))
        x = fp8.activations(inputs, a_scale, mode, group_k)
        for s, lora_a in enumerate(lora_a_weights):
            lora_a = fp8.weights(as_3d(lora_a), b_scale[s] if mode != "none" else None, mode, group_n, group_k)
            kernels.shrink(x, lora_a, output_tensor[s], slots, scaling)

    def lora_expand_fp8(self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, b_scale,
                        a_scale=None, offset_start=0, add_inputs=False, group_k=0, group_n=0, use_fp8_w8a8=False,
                        per_channel_quant=False):
        """``lora_expand`` on dequantized values; one ``a_scale`` serves every slice, as in vLLM's kernel."""
        if bool(no_lora_flag_cpu.item()):
            return
        mode = fp8.granularity(use_fp8_w8a8, per_channel_quant, group_k, group_n)
        slots = kernels.slots_from_sorted_tokens(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                 lora_token_start_loc, lora_ids, inputs.size(1))
        column = offset_start
        for s, lora_b in enumerate(lora_b_weights):
            lora_b = fp8.weights(as_3d(lora_b), b_scale[s] if mode != "none" else None, mode, group_n, group_k)
            fp8.expand(fp8.activations(inputs[s], a_scale, mode, group_k), lora_b, output_tensor, slots, column, add_inputs)
            column += lora_b.size(1)


def _one_slice(lora_b: torch.Tensor, slice_size: int) -> torch.Tensor:
    if slice_size != lora_b.size(1):
        raise ValueError(f"slice_size {slice_size} differs from the LoRA-B width {lora_b.size(1)}")
    return lora_b
