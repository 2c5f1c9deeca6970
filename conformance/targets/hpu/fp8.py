"""vLLM's fp8 LoRA kernel ops, ``lora_shrink_fp8`` and ``lora_expand_fp8``, on the HPU engine.

What they compute (vLLM 0.32.0 ``vllm/lora/ops/triton_ops/lora_shrink_fp8_op.py``,
``lora_expand_fp8_op.py`` and ``fp8_kernel_utils.py``, unchanged in 0.33.0). For a row ``t`` whose slot
``l`` is not −1, ``q`` the stored codes and ``σ`` their dequantization scales::

    shrink  out[s, t, n]       = round_out(scaling · Σ_k x_q[t,k]·σx(t,k) · A_q[l,n,k]·σA(l,n,k))
    expand  out[t, c_s + n]    = round_out((out if add_inputs else 0) + round_out(Σ_r s_q[s,t,r]·σs(t,r) · B_q[l,n,r]·σB(l,n,r)))

``c_s`` is ``offset_start`` plus the widths of the slices before ``s``; the expand has no ``scaling``.
The scales are read at the granularity the kernel picks (:class:`Quant`), only when ``use_fp8_w8a8``;
without it nothing is scaled and the operands are multiplied as they are. vLLM's shrink zeroes its
whole output first; this one, like the target's ``lora_shrink``, writes the rows of an adapter only and
leaves rows of slot −1 and the columns past the rank as given (a zeroed buffer from the wrapper, so the
values agree); the expand never touches rows of slot −1 or columns outside its slices.

How it runs, per device (docs/hpu.md, "fp8"):

* **the CPU** (``hpu-emulated``): the codes are decoded with ``.to(float32)`` (every e4m3fn and e5m2
  value is a float32), multiplied by their scales in float32, and the product runs through the same
  mask (or gather) math as ``lora_shrink``/``lora_expand``, accumulating in float32;
* **Gaudi 3**: tensor-wise and per-channel scales with fp8 on both sides go to the MME's fp8 GEMM,
  ``torch.ops.hpu.fp8_gemm_v2``, the token scales as its row scales; block scales vary along the
  contraction, which one GEMM cannot scale, so those dequantize as on the CPU;
* **Gaudi 2**: its e4m3 format tops out at ±240, so an e4m3fn code above 240 (up to 448) would not
  survive a cast or the fp8 MME. The codes are decoded exactly instead, through a 256-entry float32
  table indexed by the raw byte, and dequantized as on the CPU. (vllm-gaudi halves e4m3fn weights on
  load for Gaudi 2 and doubles their scales, ``gaudi_weight_wrapper``: exact for normal codes, but the
  odd subnormal codes round, and activations would need the same; a conformance target must not.)

All of it is static-shaped: the scale grids are built with ``repeat_interleave`` by Python integers
derived from shapes, the activation scales are padded with the rows to the bucket, and nothing reads a
tensor value on the host (``no_lora_flag_cpu`` is a CPU tensor by contract, as in ``kernels``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import gather_math, mask_math
from .device import CpuDeviceLayer
from .engine import LoRAEngine, _check_rows, _columns, pad_rows
from .rows import PaddedRows
from .stacks import as_3d

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GAUDI2_E4M3_MAX = 240.0  # Gaudi 2's e4m3 saturates here; torch.float8_e4m3fn reaches 448


# -- the quantization scheme of one call -------------------------------------------------------


@dataclass(frozen=True)
class Quant:
    """Which scales apply and how finely, decided as vLLM's kernel decides: block when both group sizes
    are positive (whatever ``per_channel_quant`` says), else per channel, else per tensor; ``"none"``
    without ``use_fp8_w8a8``."""

    granularity: str  # "none" | "tensor" | "channel" | "block"
    group_n: int = 0
    group_k: int = 0

    @classmethod
    def of(cls, use_fp8_w8a8: bool, per_channel_quant: bool, group_k: int, group_n: int) -> Quant:
        if not use_fp8_w8a8:
            return cls("none")
        if group_k > 0 and group_n > 0:
            return cls("block", int(group_n), int(group_k))
        return cls("channel" if per_channel_quant else "tensor")


def weight_scales(b_scale: torch.Tensor, rows: int, cols: int, quant: Quant) -> torch.Tensor:
    """σ of a weight stack ``[L, rows, cols]``, broadcastable to it, in float32.

    tensor ``[L, …]`` → slot ``l``'s first scale; channel ``[L, rows]`` (or with unit dims) → one per output
    row; block ``[L, (1,) ⌈rows/group_n⌉, ⌈cols/group_k⌉]`` → each ``group_n × group_k`` tile its own.
    """
    slots = b_scale.size(0)
    per_slot = b_scale.reshape(slots, -1).to(torch.float32)
    if quant.granularity == "tensor":
        return per_slot[:, :1, None]
    if quant.granularity == "channel":
        return per_slot[:, :rows, None]
    tiles = per_slot.reshape(slots, -(-rows // quant.group_n), -(-cols // quant.group_k))
    grid = tiles.repeat_interleave(quant.group_n, dim=1)[:, :rows]
    return grid.repeat_interleave(quant.group_k, dim=2)[:, :, :cols]


def activation_scales(a_scale: torch.Tensor, rows: int, cols: int, quant: Quant) -> torch.Tensor:
    """σ of activations ``[rows, cols]``, broadcastable to them, in float32 (``rows`` already padded).

    tensor → the first element; channel → one per token (``a_scale[t, 0]``); block → ``a_scale[t, k //
    group_k]``. A 1-D ``a_scale`` has no token stride in the kernel, so its first element serves every
    token; a 2-D one comes padded to the bucket (:func:`pad_scale_rows`; padding rows carry no adapter).
    """
    if a_scale.ndim < 2 or quant.granularity == "tensor":
        return a_scale.reshape(-1)[:1].to(torch.float32).reshape(1, 1)
    if a_scale.size(0) != rows:
        raise ValueError(f"a per-token activation scale has {a_scale.size(0)} rows for {rows} padded rows")
    per_token = a_scale.reshape(rows, -1).to(torch.float32)
    if quant.granularity == "channel":
        return per_token[:, :1]
    return per_token.repeat_interleave(quant.group_k, dim=1)[:, :cols]


# -- decoding the codes -------------------------------------------------------------------------


def cast_decode(codes: torch.Tensor) -> torch.Tensor:
    """The values as float32 by a cast: exact wherever the device's fp8 format is the tensor's own."""
    return codes.to(torch.float32)


class TableDecode:
    """fp8 codes → float32 through a 256-entry table indexed by the raw byte, never by an fp8 cast.

    For Gaudi 2, whose e4m3 saturates at ±240: the table is built on the CPU by torch's own decoding of
    every byte (exact, NaN codes included), and the lookup is one ``index_select`` of static shape.
    Other dtypes are cast as usual.
    """

    def __init__(self, device: torch.device) -> None:
        every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        self.tables = {dtype: every_byte.view(dtype).to(torch.float32).to(device) for dtype in FP8_DTYPES}

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        table = self.tables.get(codes.dtype)
        if table is None:
            return cast_decode(codes)
        index = codes.contiguous().view(torch.uint8).to(torch.int32).reshape(-1)
        return table.index_select(0, index).reshape(codes.shape)


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None, decode: Callable) -> torch.Tensor:
    values = decode(codes) if codes.dtype in FP8_DTYPES else codes.to(torch.float32)
    return values if scales is None else values * scales


# -- the core functions (pure; prepared by the device layer) -------------------------------------


def _operands(x_q, a_scale, w_q, b_scale, quant: Quant, decode: Callable):
    """The dequantized float32 activations ``[T, cols]`` and weights ``[L, rows, cols]``."""
    rows, cols = w_q.shape[1:]
    if quant.granularity == "none":
        return dequantize(x_q, None, decode), dequantize(w_q, None, decode)
    x = dequantize(x_q, activation_scales(a_scale, x_q.size(0), cols, quant), decode)
    return x, dequantize(w_q, weight_scales(b_scale, rows, cols, quant), decode)


def mask_shrink(x_q, a_scale, w_q, b_scale, mask, scaling: float, quant: Quant, decode: Callable) -> torch.Tensor:
    """``[T, R]`` float32: each row's ``scaling · x[t] @ A[l]ᵀ`` of the dequantized operands (0 without adapter)."""
    x, w = _operands(x_q, a_scale, w_q, b_scale, quant, decode)
    return mask_math.shrink_rows(x, w.flatten(0, 1), mask, scaling, w.size(1))


def gather_shrink(x_q, a_scale, w_q, b_scale, index, row_active, scaling: float, quant: Quant, decode: Callable) -> torch.Tensor:
    x, w = _operands(x_q, a_scale, w_q, b_scale, quant, decode)
    return gather_math.shrink_rows(x, w, index, row_active, scaling)


def mask_expand(s_q, a_scale, w_q, b_scale, mask, quant: Quant, decode: Callable) -> torch.Tensor:
    """``[T, N]`` float32: each row's ``s[t] @ B[l]ᵀ`` of the dequantized operands, not rounded
    (``weight_dtype`` float32: the kernel does not round its input before the dot, ``CAST_TYPE`` is off)."""
    s, w = _operands(s_q, a_scale, w_q, b_scale, quant, decode)
    b_flat = w.transpose(1, 2).flatten(0, 1)  # [L·R, N]: row l·R + r is B[l, :, r]
    return mask_math.expand_rows(s, b_flat, mask, torch.float32)


def gather_expand(s_q, a_scale, w_q, b_scale, index, row_active, quant: Quant, decode: Callable) -> torch.Tensor:
    s, w = _operands(s_q, a_scale, w_q, b_scale, quant, decode)
    return gather_math.expand_rows(s, w, index, row_active, torch.float32)


# Gaudi 3: the MME's fp8 GEMM, ``gemm(A, trans_A, B, trans_B, D, out_dtype, A_scale_inv, B_scale_inv, bias,
# accumulate)`` (habana_frameworks' torch.ops.hpu.fp8_gemm_v2): the product of the codes, each output
# element multiplied by its row's A scale ([M, 1] or [1]) and its column's B scale ([1, N] or [1]).


def native_shrink(x_q, a_scale, w_q, b_scale, mask, scaling: float, quant: Quant, gemm: Callable) -> torch.Tensor:
    """The mask shrink on fp8 codes: the columns of ``A_flat`` are (slot, rank) pairs, so tensor- and
    channel-wise weight scales are column scales, ``[1, L·R]``; the token scales are row scales."""
    slots, rank, hidden = w_q.shape
    row_scale = activation_scales(a_scale, x_q.size(0), hidden, quant)
    column_scale = weight_scales(b_scale, rank, hidden, quant).expand(slots, rank, 1).reshape(1, slots * rank)
    every_slot = gemm(x_q, False, w_q.reshape(slots * rank, hidden), True, None, torch.float32, row_scale, column_scale, None, False)
    return mask_math.select(torch.where(mask, every_slot * scaling, 0.0), rank)


def native_expand(s_q, a_scale, w_q, b_scale, mask, onehot, quant: Quant, gemm: Callable) -> torch.Tensor:
    """The mask expand on fp8 codes. The contraction runs over (slot, rank), and a weight scale depends on
    the slot, so the GEMM gets no B scale; since each row has one slot, its slot's scale row is applied to
    the output instead (a one-hot product, exact). Codes are spread and masked as bytes: no fp8 arithmetic."""
    slots, width, rank = w_q.shape
    codes = s_q.contiguous().view(torch.uint8).repeat(1, slots)
    spread = torch.where(mask, codes, 0).view(s_q.dtype)  # byte 0 is +0.0 in both fp8 formats
    b_codes = w_q.transpose(1, 2).reshape(slots * rank, width).contiguous().view(torch.uint8)
    b_used = torch.where(mask.any(0)[:, None], b_codes, 0).view(w_q.dtype)  # a NaN code of an unused slot meets no zero
    row_scale = activation_scales(a_scale, s_q.size(0), rank, quant)
    product = gemm(spread, False, b_used, False, None, torch.float32, row_scale, None, None, False)
    per_slot = weight_scales(b_scale, width, rank, quant)[:, :, 0].expand(slots, width)  # [L, N]
    used = onehot.any(0)
    return product * (onehot.to(torch.float32) @ torch.where(used[:, None], per_slot, 0.0))


# -- the device's fp8 capabilities ---------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Backend:
    """How this device runs fp8: the decoder of the dequantize path, and the native GEMM if any."""

    name: str
    decode: Callable[[torch.Tensor], torch.Tensor]
    gemm: Callable | None = None

    def native(self, quant: Quant, *tensors: torch.Tensor) -> bool:
        """Whether the native GEMM serves this call: tensor/channel scales and fp8 on both sides."""
        return (
            self.gemm is not None
            and quant.granularity in ("tensor", "channel")
            and all(t.dtype in FP8_DTYPES for t in tensors)
        )


def gaudi_generation() -> str:
    """``"gaudi2"``, ``"gaudi3"`` or ``"unknown"``, read from the loaded bridge as vllm-hpu-extension's
    ``is_hpu_gaudi2`` reads it (``habana_frameworks.torch.utils.experimental._get_device_type()``)."""
    try:
        htexp = importlib.import_module("habana_frameworks.torch.utils.experimental")
        device_type, kinds = htexp._get_device_type(), htexp.synDeviceType
    except Exception:  # noqa: BLE001 - a bridge without it: treat the device as unknown, i.e. safely
        return "unknown"
    if device_type == getattr(kinds, "synDeviceGaudi2", object()):
        return "gaudi2"
    if device_type == getattr(kinds, "synDeviceGaudi3", object()):
        return "gaudi3"
    return "unknown"


def hpu_fp8_gemm() -> Callable | None:
    """``torch.ops.hpu.fp8_gemm_v2`` where the loaded bridge registered it, else ``None``."""
    try:
        return torch.ops.hpu.fp8_gemm_v2
    except (AttributeError, RuntimeError):
        return None


def backend_for(layer) -> Fp8Backend:
    """The CPU casts; Gaudi 3 casts and has the fp8 GEMM; Gaudi 2, and a Gaudi this code does not know,
    decode through the table and dequantize (never an fp8 cast that could saturate)."""
    if isinstance(layer, CpuDeviceLayer):
        return Fp8Backend("cpu: cast, float32 GEMM", cast_decode)
    generation = gaudi_generation()
    gemm = hpu_fp8_gemm()
    if generation == "gaudi3" and gemm is not None:
        return Fp8Backend("gaudi3: fp8_gemm_v2 (tensor/channel), else cast and float32 GEMM", cast_decode, gemm)
    return Fp8Backend(f"{generation}: byte-table decode, float32 GEMM", TableDecode(layer.device))


# -- the steps into caller tensors ---------------------------------------------------------------


class Fp8Steps:
    """The fp8 shrink and expand into caller tensors, over an engine's buckets, variant and device layer."""

    def __init__(self, engine: LoRAEngine, backend: Fp8Backend | None = None) -> None:
        self.engine = engine
        self.backend = backend if backend is not None else backend_for(engine.layer)
        prepare, decode, gemm = engine.layer.prepare, self.backend.decode, self.backend.gemm
        if engine.variant.name == "mask":
            self._shrink = prepare(functools.partial(mask_shrink, decode=decode))
            self._expand = prepare(functools.partial(mask_expand, decode=decode))
        else:
            self._shrink = prepare(functools.partial(gather_shrink, decode=decode))
            self._expand = prepare(functools.partial(gather_expand, decode=decode))
        if gemm is not None:
            self._native_shrink = prepare(functools.partial(native_shrink, gemm=gemm))
            self._native_expand = prepare(functools.partial(native_expand, gemm=gemm))

    def _rows_args(self, rows: PaddedRows, slots: int, rank: int) -> tuple:
        if self.engine.variant.name == "mask":
            return (rows.mask(slots, rank),)
        return (rows.gather_index, rows.row_active)

    def shrink(self, out, x, lora_a, b_scale, a_scale, rows: PaddedRows, scaling: float, quant: Quant) -> None:
        """``out[t, :R] = round(scaling · x[t] @ A[l]ᵀ)`` for rows with an adapter; rows of slot −1 are left as given."""
        w = as_3d(lora_a)
        slots, rank, hidden = w.shape
        _check_rows(rows, x=x, out=out)
        if x.size(-1) != hidden:
            raise ValueError(f"inputs have {x.size(-1)} features but LoRA-A expects {hidden}")
        if out.size(-1) < rank:
            raise ValueError(f"the output has {out.size(-1)} columns, fewer than the rank {rank}")
        x_pad, a_scale = pad_rows(x, rows.padded), pad_scale_rows(a_scale, rows)
        if self.backend.native(quant, x, w):
            shrunk = self._native_shrink(x_pad, a_scale, w, b_scale, rows.mask(slots, rank), scaling, quant)
        else:
            shrunk = self._shrink(x_pad, a_scale, w, b_scale, *self._rows_args(rows, slots, rank), scaling, quant)
        target = out[:, :rank]  # rows with an adapter replaced (rounded once); the others, and columns past R, as given
        self.engine._write(target, self.engine._merge(pad_rows(target, rows.padded), shrunk, rows.row_active, False), rows)

    def expand(self, out, s, lora_b, b_scale, a_scale, rows: PaddedRows, column: int, add_inputs: bool, quant: Quant) -> None:
        """``out[t, column:column+N] = round((out if add_inputs else 0) + round(s[t] @ B[l]ᵀ))`` for rows with an adapter."""
        w = as_3d(lora_b)
        slots, width, rank = w.shape
        _check_rows(rows, x=s, out=out)
        if s.size(-1) != rank:
            raise ValueError(f"inputs have rank {s.size(-1)} but LoRA-B has rank {rank}")
        target = _columns(out, column, width)
        s_pad, a_scale = pad_rows(s, rows.padded), pad_scale_rows(a_scale, rows)
        if self.backend.native(quant, s, w):
            delta = self._native_expand(s_pad, a_scale, w, b_scale, rows.mask(slots, rank), rows.onehot(slots), quant)
        else:
            delta = self._expand(s_pad, a_scale, w, b_scale, *self._rows_args(rows, slots, rank), quant)
        self.engine._finish(target, delta.to(out.dtype), rows, add_inputs, None)


def moe_operands(x_q, act_scale, a_stacks, a_scales, b_stacks, b_scales, quant: Quant, decode: Callable):
    """``fused_moe_lora_fp8``'s operands dequantized to float32: the activations ``[rows, K]`` and every
    ``[L, E, ·, ·]`` stack. Each (slot, expert) is scaled as one slot of the dense layouts (its scale
    ``[L, E]``, ``[L, E, N(, 1)]`` or ``[L, E, ⌈N/gn⌉, ⌈K/gk⌉]`` read with the first two dimensions as one),
    since vLLM's kernel indexes the scale by slot and expert as it indexes the weights."""

    def stack(w_q, scale):
        flat = w_q.reshape(-1, *w_q.shape[2:])  # [L·E, N, K]
        if quant.granularity == "none":
            return dequantize(flat, None, decode).reshape(w_q.shape)
        per_expert = scale.reshape(-1, *scale.shape[2:])
        return dequantize(flat, weight_scales(per_expert, *flat.shape[1:], quant), decode).reshape(w_q.shape)

    if quant.granularity == "none":
        x = dequantize(x_q, None, decode)
    else:
        x = dequantize(x_q, activation_scales(act_scale, x_q.size(0), x_q.size(1), quant), decode)
    a_scales = a_scales if quant.granularity != "none" else [None] * len(a_stacks)
    b_scales = b_scales if quant.granularity != "none" else [None] * len(b_stacks)
    return x, [stack(a, s) for a, s in zip(a_stacks, a_scales)], [stack(b, s) for b, s in zip(b_stacks, b_scales)]


def check_scales(name: str, quant: Quant, stacks: list[torch.Tensor], b_scale, a_scale) -> None:
    """The arguments vLLM's op asserts or needs: one weight scale per slice and an activation scale under w8a8."""
    if quant.granularity == "none":
        return
    if a_scale is None or b_scale is None:
        raise ValueError(f"{name} with use_fp8_w8a8 needs a_scale and b_scale")
    if len(b_scale) != len(stacks):
        raise ValueError(f"{name}: {len(b_scale)} weight scales for {len(stacks)} slices")


def pad_scale_rows(a_scale: torch.Tensor | None, rows: PaddedRows) -> torch.Tensor | None:
    """A per-token (2-D) activation scale padded with the rows to the bucket, so that the core functions see
    bucket-sized tensors only (a row count inside them would be a recompile per batch size)."""
    if a_scale is None or a_scale.ndim < 2:
        return a_scale
    return F.pad(a_scale.reshape(a_scale.size(0), -1), (0, 0, 0, rows.padded - a_scale.size(0)))
