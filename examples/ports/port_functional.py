"""Functional ops: kernels that return the new value of their output instead of writing it (docs/ports.md §1)."""

import torch

from conformance.targets.functional import FunctionalKernelTarget, functional_op


class FunctionalPort(FunctionalKernelTarget):
    name = "port-functional"
    dtypes = frozenset({torch.float32})

    @functional_op
    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        new = output_tensor.clone()  # the output arrives read-only: build its new value
        a = lora_a_weights.squeeze(1) if lora_a_weights.ndim == 4 else lora_a_weights  # [L, R, H]
        for row, slot in enumerate(lora_indices_tensor.tolist()):
            if slot >= 0:
                new[row, : a.size(1)] += scaling * (inputs[row].float() @ a[slot].float().T)
        return new  # the whole output, its shape and dtype; the suite copies it in

    @functional_op
    def bgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                          slice_size, add_inputs=True):
        new = output_tensor.clone()
        b = lora_b_weights.squeeze(1) if lora_b_weights.ndim == 4 else lora_b_weights  # [L, N, R]
        columns = slice(slice_offset, slice_offset + slice_size)
        for row, slot in enumerate(lora_indices_tensor.tolist()):
            if slot >= 0:  # rows without an adapter come back as they were given
                delta = inputs[row].to(b.dtype).float() @ b[slot].float().T
                base = new[row, columns].float() if add_inputs else 0.0
                new[row, columns] = (base + delta.to(b.dtype).float()).to(new.dtype)
        return new
