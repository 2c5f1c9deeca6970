"""Kernels of another signature behind the suite's kernel ops, through declared adapters (docs/ports.md §6)."""

import torch

from conformance.targets.kernel_adapter import adapt
from conformance.targets.kernel_target import KernelTarget


def shrink(x, weights, rows, out, *, scale):
    """The backend's shrink: writes ``out``, its own names and order, a keyword-only scale."""
    for row, slot in enumerate(rows.tolist()):
        if slot >= 0:
            out[row, : weights.size(1)] += scale * (x[row].float() @ weights[slot].float().T)


def expand_slice(x, weights, rows, current, offset, accumulate):
    """The backend's expand: returns the new output instead of writing ``current``."""
    new = current.clone()
    columns = slice(offset, offset + weights.size(1))
    for row, slot in enumerate(rows.tolist()):
        if slot >= 0:
            delta = (x[row].to(weights.dtype).float() @ weights[slot].float().T).to(weights.dtype).float()
            new[row, columns] = ((new[row, columns].float() if accumulate else 0.0) + delta).to(new.dtype)
    return new


def squeezed(name):
    """An op argument as the backend takes its weights: ``[L, rows, cols]`` (vLLM's layers may add a dim 1)."""
    return lambda arguments: arguments[name].squeeze(1) if arguments[name].ndim == 4 else arguments[name]


class AdaptedPort(KernelTarget):
    name = "port-kernel-adapter"
    dtypes = frozenset({torch.float32})
    wrapper_paths = ("bgmv",)  # the two kernels below carry add_shrink, add_expand and add_lora_linear

    bgmv_shrink = adapt(shrink, {"x": "inputs", "weights": squeezed("lora_a_weights"), "rows": "lora_indices_tensor",
                                 "out": "output_tensor", "scale": "scaling"})
    bgmv_expand_slice = adapt(expand_slice, ["inputs", squeezed("lora_b_weights"), "lora_indices_tensor",
                                             "output_tensor", "slice_offset", "add_inputs"], returns="output")
