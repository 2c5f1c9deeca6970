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

Drawn values almost never give the codes where fp8 formats and ports differ, so each operand also gets
them on purpose (:func:`place_special_codes`): −0, +0, +448, −448 and the smallest subnormals ±2⁻⁹, once
each, at positions drawn from the case's generator among the codes the op reads (rows served by an
adapter, ranks below the slot's rank), each over a code below 448: every group keeps its largest code,
448, and its scale. A placed code is what the quantizer gives a value of that size in its group.
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


# -- the special codes, placed on purpose -----------------------------------------------------------------

SMALLEST_SUBNORMAL = 2.0**-9  # e4m3fn's smallest positive code (0x01): 2⁻⁶ · 1/8
SPECIAL_CODES = (-0.0, FP8_MAX, -FP8_MAX, SMALLEST_SUBNORMAL, -SMALLEST_SUBNORMAL, 0.0)
"""The codes every fp8 operand holds where the op reads them, and why each is there (in the order they are placed):

* −0 (0x80): e4m3fnuz (AMD's fp8 before MI350) has no −0, its 0x80 is NaN. A port that reinterprets e4m3fn
  codes as fnuz must set 0x80 to 0 (and double the scale: vLLM's ``normalize_e4m3fn_to_e4m3fnuz`` does both);
  without that fix −0 becomes NaN. Drawn values hold −0 only by chance (a value that rounds to zero).
* ±448 (0x7E, 0xFE): e4m3fn's largest codes, beyond Gaudi 2's e4m3 range (saturating at ±240); a group's
  largest value already lands there, these put both signs into every operand.
* ±2⁻⁹ (0x01, 0x81): the smallest subnormals, which a target that flushes fp8 subnormals to zero (or converts
  through a format without them) loses.
* +0 (0x00): zero, next to −0: rank padding holds +0 too, but where the op multiplies it by zero weights.
"""


def _row_slots(case: Case) -> list[int]:
    """The slot whose weights each input row of the op is multiplied with, −1 where the op skips the row: a token's
    slot (dense fp8 ops); for fused_moe_lora_fp8 a pair's (one row per pair with the routing weight), or a
    token's where one of its pairs is served (an enabled slot and a local expert)."""
    if not case.top_k:
        return list(case.token_slots)
    pairs = [slot if case.serves(slot, expert) else -1 for slot, experts in zip(case.token_slots, case.topk_ids) for expert in experts]
    if case.routed_weight:
        return pairs
    return [max(pairs[t * case.top_k : (t + 1) * case.top_k]) for t in range(case.num_tokens)]  # the token's slot, or −1


def _served_experts(case: Case) -> set[tuple[int, int]]:
    """The (slot, local expert) stacks fused_moe_lora_fp8 reads for some served pair."""
    return {
        (slot, case.local_expert(expert))
        for slot, experts in zip(case.token_slots, case.topk_ids)
        for expert in experts
        if case.serves(slot, expert)
    }


def place_special_codes(gen: torch.Generator, codes: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """``codes`` with each of :data:`SPECIAL_CODES` written once, at distinct positions drawn from ``gen`` among
    those where ``read`` (bool, the shape of ``codes``: the elements the op multiplies with a served row's
    weights) is set and the code is below 448 in magnitude. Every scale group so keeps its largest code, 448
    (or its saturated top), and its scale stays the quantizer's: a placed ±448 is a value of the group's amax,
    the others values the quantizer rounds to them. An operand the op reads fewer than six codes below 448 of
    (a rank-1 LoRA-B with a scale per channel: every group is one code, 448) gets the first ones that fit."""
    flat = codes.float().flatten()
    candidates = torch.nonzero(read.flatten() & (flat.abs() < FP8_MAX)).flatten()
    chosen = candidates[torch.randperm(candidates.numel(), generator=gen)[: len(SPECIAL_CODES)]]
    flat[chosen] = torch.tensor(SPECIAL_CODES[: chosen.numel()])
    return flat.reshape(codes.shape).to(FP8_DTYPE)


def activations(gen: torch.Generator, case: Case, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation codes ``[T, K]`` (shrink; fused_moe_lora_fp8's ``[rows, K]``) or ``[S, T, K]`` (expand: one
    scale serves every slice, as vLLM reads it) and ``a_scale``: ``[1]`` per tensor, ``[T, 1]`` per token,
    ``[T, ⌈K/group_k⌉]`` per block. The special codes go into rows served by an adapter, in the expand below
    the row's slot's rank (the ranks above it meet zeroed LoRA-B columns)."""
    *slices, rows, k = shape
    # a group spans every slice; along (rows, K): all of it, one row, one row and group_k columns
    group = {"tensor": (rows, k), "channel": (1, k), "block": (1, case.group_k or 1)}[case.fp8_scales]
    codes, scales = quantize(gen, shape, (*slices, *group), 1.0)
    read = torch.zeros(rows, k, dtype=torch.bool)
    for row, slot in enumerate(_row_slots(case)):
        if slot != -1:
            read[row, : case.adapter_ranks[slot] if slices else k] = True
    codes = place_special_codes(gen, codes, read.expand(shape))
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
    """``[L, R, H]`` codes, rows at and above each slot's rank zero, the special codes in the rows below the
    rank of a slot some token uses, and their ``b_scale``."""
    codes, scales = weights(gen, case, case.max_rank, case.hidden_size, case.hidden_size)
    stack = codes.float()
    read = torch.zeros(stack.shape, dtype=torch.bool)
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, rank:, :] = 0
        read[slot, :rank, :] = slot in case.token_slots
    return place_special_codes(gen, stack.to(FP8_DTYPE), read).contiguous(), scales


def lora_b(gen: torch.Generator, case: Case, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, N, R]`` codes, columns at and above each slot's rank zero, the special codes in the columns below
    the rank of a slot some token uses, and their ``b_scale``."""
    codes, scales = weights(gen, case, width, case.max_rank, case.max_rank)
    stack = codes.float()
    read = torch.zeros(stack.shape, dtype=torch.bool)
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, rank:] = 0
        read[slot, :, :rank] = slot in case.token_slots
    return place_special_codes(gen, stack.to(FP8_DTYPE), read).contiguous(), scales


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
    """``[L, E, R, H]`` codes, rows at and above each slot's rank zero, the special codes in the rows below the
    rank of a (slot, expert) some served pair reads, and their ``lora_a_scale_stacked`` entry."""
    codes, scales = moe_weights(gen, case, case.max_rank, case.hidden_size, case.hidden_size)
    stack = codes.float()
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, rank:, :] = 0
    read = torch.zeros(stack.shape, dtype=torch.bool)
    for slot, expert in _served_experts(case):
        read[slot, expert, : case.adapter_ranks[slot], :] = True
    return place_special_codes(gen, stack.to(FP8_DTYPE), read).contiguous(), scales


def moe_lora_b(gen: torch.Generator, case: Case, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, E, N, R]`` codes, columns at and above each slot's rank zero, the special codes in the columns below
    the rank of a (slot, expert) some served pair reads, and their ``lora_b_scale_stacked`` entry."""
    codes, scales = moe_weights(gen, case, width, case.max_rank, case.max_rank)
    stack = codes.float()
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, :, rank:] = 0
    read = torch.zeros(stack.shape, dtype=torch.bool)
    for slot, expert in _served_experts(case):
        read[slot, expert, :, : case.adapter_ranks[slot]] = True
    return place_special_codes(gen, stack.to(FP8_DTYPE), read).contiguous(), scales
