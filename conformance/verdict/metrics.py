"""Error statistics of a result against the oracle: what the report shows for every case."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64,
             torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}  # the fp8 ops' inputs


def bitwise_differences(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Bool mask of elements whose bit patterns differ (so −0 ≠ +0 and NaN payloads count).

    What determinism compares (repeated calls must reproduce each other bit for bit); correctness
    compares values (:func:`compare_values`)."""
    if not actual.is_floating_point():  # integer tensors (routing, metadata) compare by value
        return (actual != expected) if actual.shape == expected.shape else torch.ones(expected.shape, dtype=torch.bool)
    view = _INT_VIEW[actual.dtype]
    return actual.contiguous().view(view) != expected.contiguous().view(view)


@dataclass(frozen=True)
class ValueComparison:
    """Where ``actual`` differs from ``expected``, element by element (bool masks of their shape, disjoint).

    ``changed``: another value (another number, a NaN that appeared or went, an infinity);
    ``signed_zeros``: both zero, with other signs (−0 == +0);
    ``nan_payloads``: both NaN, with other payloads or signs."""

    changed: torch.Tensor
    signed_zeros: torch.Tensor
    nan_payloads: torch.Tensor

    @property
    def bits_only(self) -> torch.Tensor:
        """The elements whose value is unchanged but whose bits differ."""
        return self.signed_zeros | self.nan_payloads


def compare_values(actual: torch.Tensor, expected: torch.Tensor) -> ValueComparison:
    """Compare by value, and tell the bit-level differences of equal values apart (same shape and dtype).

    The rule of every correctness check on what must stay as it was (the output outside its written
    region, the inputs): a ±0 or a NaN payload that changed is no wrong number. Integer tensors have
    no such pairs; their differences are all ``changed``."""
    bits = bitwise_differences(actual, expected)
    nothing = torch.zeros_like(bits)
    if not actual.is_floating_point() or not bits.any():
        return ValueComparison(bits, nothing, nothing)
    view = _INT_VIEW[actual.dtype]
    magnitude_bits = (1 << (torch.iinfo(view).bits - 1)) - 1  # every bit but the sign
    # zero by its bits, not by ``== 0``: a denormal is a value, and flushing it would hide the change
    a, e = actual.contiguous()[bits], expected.contiguous()[bits]
    zeros = ((a.view(view) & magnitude_bits) == 0) & ((e.view(view) & magnitude_bits) == 0)
    nans = a.double().isnan() & e.double().isnan()  # float64 holds every NaN of the narrower dtypes as NaN
    signed_zeros, nan_payloads = nothing.clone(), nothing.clone()
    signed_zeros[bits], nan_payloads[bits] = zeros, nans
    return ValueComparison(bits & ~(signed_zeros | nan_payloads), signed_zeros, nan_payloads)


def where(mask: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Where ``mask`` holds anywhere: its rows (dim −2), columns (dim −1) and planes (the dims before,
    flattened); a 1-D mask is one row, a 0-D one one element."""
    cube = mask.reshape((1,) * max(0, 2 - mask.dim()) + tuple(mask.shape))
    cube = cube.reshape(-1, cube.size(-2), cube.size(-1))

    def indices(hit: torch.Tensor) -> tuple[int, ...]:
        return tuple(torch.nonzero(hit).flatten().tolist())

    return {"rows": indices(cube.any(dim=0).any(dim=-1)), "columns": indices(cube.any(dim=0).any(dim=0)),
            "planes": indices(cube.any(dim=-1).any(dim=-1))}


def ulp_of(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at each value (float64), never below the smallest normal number's."""
    magnitude = values.abs().clamp_min(torch.finfo(dtype).tiny).to(dtype)
    return (torch.nextafter(magnitude, torch.tensor(math.inf, dtype=dtype)) - magnitude).double()


def max_ulp_error(actual: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype) -> float:
    if actual.numel() == 0:
        return 0.0
    return float(((actual - oracle).abs() / ulp_of(oracle, dtype)).max())


def sqnr_db(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``oracle`` in dB (inf when exact)."""
    noise = float(((actual - oracle) ** 2).sum())
    signal = float((oracle**2).sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def max_abs_error(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    return float((actual - oracle).abs().max()) if actual.numel() else 0.0


def spread(outputs: list[torch.Tensor]) -> dict | None:
    """How far repeated outputs of one call differ from the first, bit for bit: ``calls``, ``identical``,
    ``differing_elements`` and ``max_abs_difference`` (``"inf"`` where a NaN, an infinity, another shape or
    dtype makes it unbounded, so the record stays JSON); None for fewer than two outputs."""
    if len(outputs) < 2:
        return None
    first, differing, largest = outputs[0], 0, 0.0
    for output in outputs[1:]:
        if output.shape != first.shape or output.dtype != first.dtype:
            differing, largest = differing + max(first.numel(), 1), math.inf
            continue
        mask = bitwise_differences(output, first)
        if mask.any():
            differing += int(mask.sum())
            gap = (output[mask].double() - first[mask].double()).abs().nan_to_num(nan=math.inf)
            largest = max(largest, float(gap.max()))
    return {"calls": len(outputs), "identical": differing == 0, "differing_elements": differing,
            "max_abs_difference": largest if math.isfinite(largest) else "inf"}
