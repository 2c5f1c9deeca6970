"""The verdict on one result: inside the error budget, untouched where it must be, finite.

Inputs (all the op's output tensor, same shape):
  ``actual``   what the target wrote;
  ``oracle``   the reference in float64 on the same inputs;
  ``baseline`` the reference in the case dtype (what straightforward low-precision code gives);
  ``initial``  the output before the call;
  ``written``  bool mask of the elements the op may write.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .failure_kind import FailureKind
from .metrics import bitwise_differences, max_abs_error, max_ulp_error, sqnr_db
from .tolerances import tolerance_for


@dataclass(frozen=True)
class Measurement:
    max_abs_error: float
    scaled_error: float  # max_abs_error / max |oracle|
    max_ulp: float
    sqnr_db: float
    baseline_error: float
    budget: float
    budget_ratio: float  # max_abs_error / budget: ≤ 1 passes
    output_scale: float
    checked_elements: int

    def to_json(self) -> dict:
        return {k: (v if v == v and abs(v) != float("inf") else str(v)) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Problem:
    kind: FailureKind
    text: str
    rows: tuple[int, ...] = ()  # output rows (dim −2) where it shows, so messages can name their slots
    columns: tuple[int, ...] = ()  # output columns (dim −1) where it shows, so results can name their slices
    planes: tuple[int, ...] = ()  # indices over the dims before −2, flattened (a shrink buffer's slice)


@dataclass(frozen=True)
class Verdict:
    problems: tuple[Problem, ...]
    measurement: Measurement | None

    @property
    def passed(self) -> bool:
        return not self.problems


def _where(mask: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Where ``mask`` holds anywhere: its rows (dim −2), columns (dim −1) and planes (the dims before, flattened)."""
    cube = mask.reshape(-1, mask.size(-2), mask.size(-1))

    def indices(hit: torch.Tensor) -> tuple[int, ...]:
        return tuple(torch.nonzero(hit).flatten().tolist())

    return {"rows": indices(cube.any(dim=0).any(dim=-1)), "columns": indices(cube.any(dim=0).any(dim=0)),
            "planes": indices(cube.any(dim=-1).any(dim=-1))}


def judge(
    actual: torch.Tensor,
    oracle: torch.Tensor,
    baseline: torch.Tensor,
    initial: torch.Tensor,
    written: torch.Tensor,
) -> Verdict:
    if actual.shape != oracle.shape or actual.dtype != initial.dtype:
        problem = (
            f"output has shape {tuple(actual.shape)} and dtype {actual.dtype}; "
            f"expected {tuple(oracle.shape)} and {initial.dtype}"
        )
        return Verdict((Problem(FailureKind.WRONG_OUTPUT_TYPE, problem),), None)

    problems: list[Problem] = []
    outside = bitwise_differences(actual, initial) & ~written
    if outside.any():
        problems.append(Problem(FailureKind.OUTSIDE_REGION, f"wrote {int(outside.sum())} element(s) it must leave untouched", **_where(outside)))

    a, o, b = actual[written].double(), oracle[written].double(), baseline[written].double()
    nonfinite = torch.zeros_like(written)
    nonfinite[written] = ~torch.isfinite(a) & torch.isfinite(o)
    if nonfinite.any():
        problems.append(Problem(FailureKind.NAN_INF, f"{int(nonfinite.sum())} NaN/Inf element(s) where the oracle is finite", **_where(nonfinite)))

    finite = torch.isfinite(a) & torch.isfinite(o)
    a, o, b = a[finite], o[finite], b[finite]
    tol = tolerance_for(actual.dtype)
    scale = float(o.abs().max()) if o.numel() else 0.0
    scale = scale if scale > 0 else 1.0
    error = max_abs_error(a, o)
    baseline_error = max_abs_error(b, o)
    floor = tol.floor_ulps * torch.finfo(actual.dtype).eps * scale
    budget = tol.k * baseline_error + floor
    cap = tol.rtol * scale
    measurement = Measurement(
        max_abs_error=error,
        scaled_error=error / scale,
        max_ulp=max_ulp_error(a, o, actual.dtype),
        sqnr_db=sqnr_db(a, o),
        baseline_error=baseline_error,
        budget=min(budget, cap),
        budget_ratio=error / min(budget, cap),
        output_scale=scale,
        checked_elements=int(written.sum()),
    )
    if error > budget or error > cap:
        which = f"{tol.k:g}× the baseline error {baseline_error:.3g} + floor {floor:.3g}" if error > budget else f"rtol cap {cap:.3g}"
        elementwise = torch.zeros(written.shape, dtype=torch.float64)
        elementwise[written] = (actual[written].double() - oracle[written].double()).abs().nan_to_num(0.0)
        text = f"max error {error:.3g} exceeds {which} (ratio {measurement.budget_ratio:.3g})"
        if not bitwise_differences(actual, initial)[written].any():
            # Not a rounding problem: nothing arrived. The usual cause is an implementation that
            # returns a new tensor instead of writing into the output it was given.
            text = (
                f"wrote nothing: the output is unchanged in all {int(written.sum())} elements it must write, "
                f"where the oracle differs by up to {max_abs_error(initial[written].double(), oracle[written].double()):.3g}; "
                "the op writes its result into its output tensor in place (returning a new tensor loses it)"
            )
            kind = FailureKind.WROTE_NOTHING
        else:
            kind = FailureKind.NUMERICS
        problems.append(Problem(kind, text, **_where(elementwise > min(budget, cap))))
    return Verdict(tuple(problems), measurement)
