"""The fp8 kernels' math: dequantize the codes by their scales, then the same loops as ``kernels``.

vLLM's ``lora_shrink_fp8`` / ``lora_expand_fp8`` take fp8 codes (``torch.float8_e4m3fn``) and float32
scales. A code's value is ``code · scale``; which scale, the call's granularity decides, as vLLM's
kernel tests it (``K`` is the contraction: the shrink's hidden size, the expand's rank):

* **block** (``group_k > 0 and group_n > 0``): ``x[t, k]`` by ``a_scale[t, k // group_k]``, ``W[l, n, k]`` by
  ``b_scale[l, n // group_n, k // group_k]``;
* **channel** (``per_channel_quant``): ``x[t, k]`` by ``a_scale[t, 0]``, ``W[l, n, k]`` by ``b_scale[l, n]``;
* **tensor**: ``x`` by ``a_scale``'s first element, ``W[l]`` by ``b_scale[l]``.

Without ``use_fp8_w8a8`` nothing is scaled. Every e4m3fn value is a float32, so ``.float()`` decodes
exactly; a device whose fp8 format differs (Gaudi 2's e4m3 saturates at ±240) must not go through it.

Two rounding rules differ from the 16-bit expand (``kernels.expand``): the input is not rounded before
the product (there is no ``CAST_TYPE`` for fp8), and the product is rounded to the *output* dtype before
it is added.
"""

from __future__ import annotations

import torch

from .kernels import rows_using


def granularity(use_fp8_w8a8: bool, per_channel_quant: bool, group_k: int, group_n: int) -> str:
    if not use_fp8_w8a8:
        return "none"
    if group_k > 0 and group_n > 0:
        return "block"
    return "channel" if per_channel_quant else "tensor"


def _repeat(scale: torch.Tensor, group: int, dim: int, size: int) -> torch.Tensor:
    """One scale per group of ``group`` indices along ``dim`` → one per index, cut to ``size``."""
    return scale.repeat_interleave(group, dim=dim).narrow(dim, 0, size)


def activations(x: torch.Tensor, a_scale: torch.Tensor | None, mode: str, group_k: int) -> torch.Tensor:
    """``[T, K]`` codes → float32 values."""
    values = x.float()
    if mode == "none":
        return values
    if mode == "tensor" or a_scale.ndim < 2:  # a 1-D a_scale has no per-token stride in vLLM's kernel
        return values * a_scale.reshape(-1)[0].float()
    if mode == "channel":
        return values * a_scale[:, :1].float()
    return values * _repeat(a_scale.float(), group_k, 1, x.size(1))


def weights(w: torch.Tensor, b_scale: torch.Tensor | None, mode: str, group_n: int, group_k: int) -> torch.Tensor:
    """``[L, N, K]`` codes → float32 values."""
    values = w.float()
    slots, n, k = w.shape
    if mode == "none":
        return values
    scale = b_scale.float().reshape(slots, -1)
    if mode == "tensor":
        return values * scale[:, :1, None]
    if mode == "channel":
        return values * scale[:, :n, None]
    blocks = scale.reshape(slots, -(-n // group_n), -(-k // group_k))
    return values * _repeat(_repeat(blocks, group_n, 1, n), group_k, 2, k)


def expand(x: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, slot_of_row: torch.Tensor, offset: int,
           add_inputs: bool) -> None:
    """``out[t, offset:offset+N] (+)= round_out(x[t] @ B[slot_t]ᵀ)`` on float32 values; other rows and columns untouched."""
    num_slots, width, rank = lora_b.shape
    if offset < 0 or offset + width > out.size(-1):
        raise ValueError(f"columns [{offset}, {offset + width}) do not fit an output of width {out.size(-1)}")
    columns = slice(offset, offset + width)
    for slot, rows in rows_using(slot_of_row, num_slots):
        delta = (x[rows] @ lora_b[slot].T).to(out.dtype)  # summed in float32, rounded to the output dtype
        if add_inputs:
            out[rows, columns] = (out[rows, columns].float() + delta.float()).to(out.dtype)
        else:
            out[rows, columns] = delta
