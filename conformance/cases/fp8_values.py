"""The values of an fp8 case: e4m3fn codes and the float32 scales that dequantize them, quantized as vLLM does.

An operand is drawn as float values ``v`` and quantized the way vLLM's dynamic quantizers do it
(``scaled_fp8_quant``, per-token-group quantization): per scale group ``g`` (the whole tensor, a slot, a
token, an output channel or a block, by the granularity) the scale is ``s_g = amax_g |v| / 448`` in
float32, and each code ``q = saturate(round(v / s_g))`` with round to nearest even and saturation at
±448 (e4m3fn's largest finite value). So a scale is an arbitrary float32 number (24 significant bits),
and ``q · s`` needs up to 28: neither a dequantized value nor the product of two is exact in bfloat16,
float16 or float32, which is what separates a target that keeps the scales in float32 from one that
rounds them, or the dequantized values, to 16 bits (docs/verdict.md, *fp8 ops*).

One operand in four is quantized with a power-of-two scale instead, ``2^⌊log2(amax/448)⌋`` (as
quantizers with exponent-only scales do): its largest values saturate at 448, and its dequantized
values and products are exact in every format, the case where only the order of the sums can differ.

Every group's largest value lands on a code of magnitude 448 (amax scales) or saturates there
(power-of-two scales), so every operand holds codes in (240, 448], the codes a target saturating at
Gaudi 2's ±240 (its e4m3 has a narrower exponent range) gets wrong. The values are
``N(0, 1) · 2^d · unit`` with ``d`` drawn per scale group from −2…2, so neighbouring scales differ by up
to 16× (a scale read for the wrong channel, token or block shows), and ``unit`` keeps every dequantized
value O(1) in the sums: activations 1, a weight over a fan-in ``f`` ``1/√f``, as in ``values.py``.
"""

from __future__ import annotations

import torch

from .case import Case

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: OCP e4m3fn, what vLLM's kernels and torch use
GAUDI2_FP8_MAX = 240.0  # Gaudi 2's e4m3 (IEEE-like, with infinities) saturates here
SCALE_SPREAD = 2  # each scale group's values are N(0, 1) · 2^(± up to this) · unit
POWER_OF_TWO_SHARE = 4  # one operand in this many gets power-of-two scales


def _groups(size: int, group: int) -> int:
    return -(-size // group)


def _spread(grid: torch.Tensor, sizes: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """A value per group (``grid``, ``⌈shape[i] / sizes[i]⌉`` along dimension ``i``) repeated out to every element."""
    for dim, size in enumerate(sizes):
        grid = grid.repeat_interleave(size, dim=dim).narrow(dim, 0, shape[dim])
    return grid


def _amax(values: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``max |v|`` over each group of ``sizes[0] × sizes[1] × …`` elements (the last group along a dimension
    may be shorter), as a grid of ``⌈shape[i] / sizes[i]⌉`` along each dimension."""
    shape = values.shape
    padded_shape = [_groups(n, g) * g for n, g in zip(shape, sizes)]
    padded = torch.zeros(padded_shape, dtype=values.dtype)
    padded[tuple(slice(0, n) for n in shape)] = values.abs()
    split = [d for n, g in zip(padded_shape, sizes) for d in (n // g, g)]
    return padded.reshape(split).amax(dim=tuple(range(1, 2 * len(shape), 2)))


def quantize(gen: torch.Generator, shape: tuple[int, ...], sizes: tuple[int, ...], unit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[shape]`` and the float32 scale grid (``⌈shape[i] / sizes[i]⌉`` along each dimension) of float
    values drawn around ``unit`` with one magnitude ``2^d`` per group, quantized per group."""
    grid_shape = tuple(_groups(n, g) for n, g in zip(shape, sizes))
    magnitude = torch.pow(2.0, torch.randint(-SCALE_SPREAD, SCALE_SPREAD + 1, grid_shape, generator=gen).double()) * unit
    values = (torch.randn(shape, generator=gen, dtype=torch.float64) * _spread(magnitude, sizes, shape)).float()
    scales = _amax(values, sizes) / FP8_MAX  # float32, as the quantizers compute it
    if int(torch.randint(POWER_OF_TWO_SHARE, (1,), generator=gen)) == 0:
        scales = torch.pow(2.0, torch.floor(torch.log2(scales)))  # at or below amax / 448: the top saturates
    codes = (values / _spread(scales, sizes, shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def activations(gen: torch.Generator, case: Case, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation codes ``[T, K]`` (shrink) or ``[S, T, K]`` (expand: one scale serves every slice, as vLLM
    reads it) and ``a_scale``: ``[1]`` per tensor, ``[T, 1]`` per token, ``[T, ⌈K/group_k⌉]`` per block."""
    *slices, rows, k = shape
    # a group spans every slice; along (rows, K): all of it, one row, one row and group_k columns
    group = {"tensor": (rows, k), "channel": (1, k), "block": (1, case.group_k or 1)}[case.fp8_scales]
    codes, scales = quantize(gen, shape, (*slices, *group), 1.0)
    scales = scales.reshape(-1, scales.size(-1)) if case.fp8_scales != "tensor" else scales.reshape(1)
    return codes, scales


def weights(gen: torch.Generator, case: Case, n: int, k: int, fan_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slice's ``[L, N, K]`` weight codes and ``b_scale``: ``[L]`` per tensor (one per slot), ``[L, N]``
    per channel, ``[L, ⌈N/group_n⌉, ⌈K/group_k⌉]`` per block. The scales are those of the whole drawn stack;
    the rows (LoRA-A) or columns (LoRA-B) past each slot's rank are zeroed afterwards."""
    sizes = {"tensor": (1, n, k), "channel": (1, 1, k), "block": (1, case.group_n or 1, case.group_k or 1)}[case.fp8_scales]
    codes, scales = quantize(gen, (case.num_slots, n, k), sizes, fan_in**-0.5)  # scales [L, ·, ·]
    shapes = {"tensor": (case.num_slots,), "channel": (case.num_slots, n), "block": tuple(scales.shape)}
    return codes, scales.reshape(shapes[case.fp8_scales])


def lora_a(gen: torch.Generator, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, R, H]`` codes, rows at and above each slot's rank zero, and their ``b_scale``."""
    codes, scales = weights(gen, case, case.max_rank, case.hidden_size, case.hidden_size)
    stack = codes.float()
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, rank:, :] = 0
    return stack.to(FP8_DTYPE).contiguous(), scales


def lora_b(gen: torch.Generator, case: Case, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, N, R]`` codes, columns at and above each slot's rank zero, and their ``b_scale``."""
    codes, scales = weights(gen, case, width, case.max_rank, case.max_rank)
    stack = codes.float()
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, rank:] = 0
    return stack.to(FP8_DTYPE).contiguous(), scales


# -- fused_moe_lora_fp8: a stack per (slot, expert), scaled per (slot, expert) ----------------------------


def moe_weights(gen: torch.Generator, case: Case, n: int, k: int, fan_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slice's ``[L, E, N, K]`` weight codes and their scales, in the layouts vLLM's MoE kernel takes the
    strides of (and its own tests build): ``[L, E]`` per tensor (one per slot and expert), ``[L, E, N, 1]``
    per output channel, ``[L, E, ⌈N/group_n⌉, ⌈K/group_k⌉]`` per block. Every (slot, expert) is quantized
    on its own, so neighbouring experts' scales differ (one read for the wrong expert shows)."""
    sizes = {"tensor": (1, 1, n, k), "channel": (1, 1, 1, k), "block": (1, 1, case.group_n or 1, case.group_k or 1)}[case.fp8_scales]
    codes, scales = quantize(gen, (case.num_slots, case.num_experts, n, k), sizes, fan_in**-0.5)  # scales [L, E, ·, ·]
    shapes = {"tensor": scales.shape[:2], "channel": (*scales.shape[:3], 1), "block": scales.shape}
    return codes, scales.reshape(shapes[case.fp8_scales])


def moe_lora_a(gen: torch.Generator, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, E, R, H]`` codes, rows at and above each slot's rank zero, and their ``lora_a_scale_stacked`` entry."""
    codes, scales = moe_weights(gen, case, case.max_rank, case.hidden_size, case.hidden_size)
    stack = codes.float()
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, rank:, :] = 0
    return stack.to(FP8_DTYPE).contiguous(), scales


def moe_lora_b(gen: torch.Generator, case: Case, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, E, N, R]`` codes, columns at and above each slot's rank zero, and their ``lora_b_scale_stacked`` entry."""
    codes, scales = moe_weights(gen, case, width, case.max_rank, case.max_rank)
    stack = codes.float()
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, :, rank:] = 0
    return stack.to(FP8_DTYPE).contiguous(), scales
