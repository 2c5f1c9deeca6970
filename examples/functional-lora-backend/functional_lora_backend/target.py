"""``FunctionalExampleTarget``: the eight dense kernel ops in NumPy, each returning its output's new value.

Each op has the name, argument order and defaults of vLLM's op and is declared with ``@functional_op``:
it receives NumPy arrays (the output's current value among them, read-only) and returns the whole new
output array. The suite's ``FunctionalKernelTarget`` converts the torch tensors it is handed with
``to_array``, converts the returned array back with ``from_array``, checks its shape and dtype and
copies it into the output tensor; ``KernelTarget`` derives the wrapper methods from these kernels.

NumPy has no bfloat16 and no fp8, so the target claims float16 and float32 only and leaves the fp8 ops
out; the fused-MoE ops are left out to keep the example short.
"""

from __future__ import annotations

import numpy as np
import torch

from conformance.targets.functional import FunctionalKernelTarget, functional_op

from . import kernels
from .kernels import as_3d


class FunctionalExampleTarget(FunctionalKernelTarget):
    name = "functional-example"
    description = "example out-of-tree backend: the dense kernel ops in NumPy, functional (each returns the new output)"
    dtypes = frozenset({torch.float16, torch.float32})  # NumPy has no bfloat16
    why_not_implemented = {
        **{op: f"NumPy has no fp8 dtype, so the NumPy example leaves {op} out" for op in ("lora_shrink_fp8", "lora_expand_fp8")},
        **{
            op: f"the example backend leaves the fused-MoE kernels out on purpose ({op}; see docs/moe.md for their contract)"
            for op in ("fused_moe_lora", "fused_moe_lora_fp8", "moe_lora_align_block_size")
        },
    }

    # -- the interop: torch tensors (on the CPU, default_device) to NumPy arrays and back -------------

    def to_array(self, tensor: torch.Tensor) -> np.ndarray:
        """A read-only NumPy view of the tensor's memory (no copy): an op that writes into an argument
        raises instead of changing the suite's tensors behind its back."""
        if tensor.dtype == torch.bfloat16:
            raise TypeError("NumPy has no bfloat16: the functional example cannot take a bfloat16 tensor "
                            "(it claims float16 and float32 only)")
        array = tensor.detach().numpy()
        array.flags.writeable = False
        return array

    def from_array(self, array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        """A tensor holding a copy of ``array`` (the returned array may be a read-only argument), on ``like``'s device."""
        return torch.from_numpy(np.array(array)).to(like.device)

    # -- bgmv: one slot per token (decode) ---------------------------------------------------------

    @functional_op
    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        return kernels.shrink(inputs, as_3d(lora_a_weights), output_tensor, lora_indices_tensor, scaling)

    @functional_op
    def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        return kernels.expand(inputs, as_3d(lora_b_weights), output_tensor, lora_indices_tensor, 0, add_inputs)

    @functional_op
    def bgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        lora_b = _one_slice(as_3d(lora_b_weights), slice_size)
        return kernels.expand(inputs, lora_b, output_tensor, lora_indices_tensor, slice_offset, add_inputs)

    # -- sgmv: one slot per segment of rows (prefill) ------------------------------------------------

    @functional_op
    def sgmv_shrink(self, inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, scaling):
        slots = kernels.slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.shape[0])
        return kernels.shrink(inputs, as_3d(lora_a_weights), output_tensor, slots, scaling)

    @functional_op
    def sgmv_expand(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                    batches, max_seq_length, token_nums, add_inputs=False):
        slots = kernels.slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.shape[0])
        return kernels.expand(inputs, as_3d(lora_b_weights), output_tensor, slots, 0, add_inputs)

    @functional_op
    def sgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                          lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset, slice_size,
                          add_inputs=False):
        slots = kernels.slots_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.shape[0])
        lora_b = _one_slice(as_3d(lora_b_weights), slice_size)
        return kernels.expand(inputs, lora_b, output_tensor, slots, slice_offset, add_inputs)

    # -- lora_*: every slice in one call, tokens sorted by slot ----------------------------------------

    @functional_op
    def lora_shrink(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling):
        """The new ``[S, T, R]`` float32 buffer: slice ``s`` gets its shrink added."""
        if no_lora_flag_cpu.item():  # every token has slot −1: the output stays as it is
            return output_tensor
        slots = kernels.slots_from_sorted_tokens(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                 lora_token_start_loc, lora_ids, inputs.shape[0])
        new = output_tensor.copy()
        for s, lora_a in enumerate(lora_a_weights):
            new[s] = kernels.shrink(inputs, as_3d(lora_a), output_tensor[s], slots, scaling)
        return new

    @functional_op
    def lora_expand(self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, offset_start=0,
                    add_inputs=False):
        """The new output: slice ``s`` (``inputs[s]``) in the columns after slices ``0 … s−1``, from ``offset_start``."""
        if no_lora_flag_cpu.item():
            return output_tensor
        slots = kernels.slots_from_sorted_tokens(token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                                                 lora_token_start_loc, lora_ids, inputs.shape[1])
        new, column = output_tensor, offset_start
        for s, lora_b in enumerate(lora_b_weights):
            lora_b = as_3d(lora_b)
            new = kernels.expand(inputs[s], lora_b, new, slots, column, add_inputs)
            column += lora_b.shape[1]
        return new


def _one_slice(lora_b: np.ndarray, slice_size: int) -> np.ndarray:
    if slice_size != lora_b.shape[1]:
        raise ValueError(f"slice_size {slice_size} differs from the LoRA-B width {lora_b.shape[1]}")
    return lora_b
