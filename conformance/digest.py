"""Digests that tie a recorded result to what it was judged on: its inputs, its case, its oracle.

A frozen case list (``conformance.caselists``) holds, for each case, the digest of the input values
the referee draws for it; every result records the digest of the values its run actually used, so a
reviewer can check from a submitted bundle that each outcome was reached on the list's inputs.

* :func:`tensors_digest`: SHA-256 over named tensors, bit for bit (name, dtype, shape, then the
  bytes of each, in name order): the same values give the same digest on any machine; one bit, one
  dtype or one shape changed gives another. Tensors are read on the CPU, contiguous.
* :func:`json_digest`: SHA-256 over canonical JSON (sorted keys, no spaces).
* :func:`oracle_fingerprint`: a few float64 sums of the float64 oracle's output. Not a hash, on
  purpose: the oracle is a float64 computation whose last bits depend on the summation order of the
  torch build that ran it (BLAS blocking, vectorised reductions), so a bit-exact hash would differ
  between the submitter's machine and the reviewer's for a correct run. The sums move by ~1e-16
  relative under reordering and by far more under any change of the inputs or of the math, so
  :func:`fingerprints_agree` compares them to 1e-9 of their scale.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping

import torch

# A multiplier of the element index for the fingerprint's weighted sum: irrational, so that moving a
# value to another element (a transposed or permuted output) changes the sum.
_PHASE = 0.7548776662466927
FINGERPRINT_FIELDS = ("elements", "nonfinite", "sum", "abs_sum", "square_sum", "weighted_sum")
FINGERPRINT_RTOL = 1e-9


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def json_digest(value) -> str:
    """The digest of a JSON-able value, independent of key order and formatting."""
    return sha256(canonical_json(value))


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest of named tensors, bit for bit (see the module docstring)."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        hasher.update(canonical_json([name, str(tensor.dtype), list(tensor.shape)]))
        if tensor.numel():
            hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + hasher.hexdigest()


def oracle_fingerprint(output: torch.Tensor) -> list[float]:
    """``FINGERPRINT_FIELDS`` of a float64 oracle output (non-finite elements counted, left out of the sums)."""
    flat = output.detach().to("cpu", torch.float64).reshape(-1)
    finite = torch.isfinite(flat)
    values = torch.where(finite, flat, torch.zeros((), dtype=torch.float64))
    weights = torch.cos(torch.arange(flat.numel(), dtype=torch.float64) * _PHASE)
    return [
        float(flat.numel()), float((~finite).sum()), float(values.sum()), float(values.abs().sum()),
        float((values * values).sum()), float((values * weights).sum()),
    ]


def fingerprints_agree(recorded, recomputed) -> bool:
    """Whether two :func:`oracle_fingerprint` lists describe the same oracle (counts exactly, sums to
    ``FINGERPRINT_RTOL`` of their scale: the absolute sum, and for the squares its own)."""
    if not (_fingerprint_shaped(recorded) and _fingerprint_shaped(recomputed)):
        return False
    elements, nonfinite, total, absolute, squares, weighted = recorded
    if (elements, nonfinite) != tuple(recomputed[:2]):
        return False
    scale = max(absolute, recomputed[3], 1e-300)
    square_scale = max(squares, recomputed[4], 1e-300)
    close = [
        abs(total - recomputed[2]) <= FINGERPRINT_RTOL * scale,
        abs(absolute - recomputed[3]) <= FINGERPRINT_RTOL * scale,
        abs(squares - recomputed[4]) <= FINGERPRINT_RTOL * square_scale,
        abs(weighted - recomputed[5]) <= FINGERPRINT_RTOL * scale,
    ]
    return all(close)


def _fingerprint_shaped(value) -> bool:
    """A list of ``FINGERPRINT_FIELDS`` finite numbers (what a bundle holds is data, checked before use)."""
    return isinstance(value, list) and len(value) == len(FINGERPRINT_FIELDS) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
