"""The verdict on one result: inside the error budget, untouched where it must be, finite.

Inputs (all the op's output tensor, same shape):
  ``actual``   what the target wrote;
  ``oracle``   the reference in float64 on the same inputs;
  ``baseline`` the reference in the case dtype (what straightforward low-precision code gives);
  ``initial``  the output before the call;
  ``written``  bool mask of the elements the op may write; elsewhere the output must keep its values
               (``metrics.compare_values``): a zero whose sign flipped, or a NaN with another payload,
               is no wrong number, and is recorded (``Measurement.bit_differences``), not failed;
  ``delta``    (optional) the oracle's delta: the float64 reference on the same inputs with the output
               zeroed, i.e. what the op adds (or, for an op that overwrites, writes). Given, the
               error's systematic part is judged too (``systematic``); without it only the budget is.
  ``magnitude`` (optional) the float64 reference on the absolute values of the inputs: the size of
               the terms each element sums (``≥ |oracle|``). Given, the budget's floor also allows
               float32 accumulation error in ulps of its largest value (``tolerances``): a dot
               product that cancels errs by ulps of its terms in any correct summation order.

Inside the budget two more rules look at the error as a whole: its part along the delta
(``systematic``: a gain) and its spread (``precision``: a 16-bit output computed through a coarser
format). Either fails the result with its own kind; a result outside the budget keeps ``numerics``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .bit_differences import OUTPUT, BitDifferences
from .failure_kind import FailureKind
from .metrics import bitwise_differences, compare_values, max_abs_error, max_ulp_error, sqnr_db, where
from .precision import precision as error_precision
from .systematic import DeltaBias, correctly_rounded, delta_bias, row_groups
from .tolerances import systematic_threshold_for, tolerance_for


def json_number(value: float | None) -> float | str | None:
    """A number as results.json holds it: finite ones as numbers, inf/-inf/nan as their text (JSON has none)."""
    return value if value is None or (value == value and abs(value) != float("inf")) else str(value)


def number_from_json(value) -> float | None:
    """What :func:`json_number` wrote, as a float (``"inf"`` → inf); None for None, NaN or anything else."""
    if isinstance(value, str) and value in ("inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


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
    operand_scale: float | None = None  # max |base| + |delta| (max |oracle| without a delta): floor and cap scale
    magnitude_scale: float | None = None  # max of the magnitude (the size of the terms summed); None without one
    # the systematic part of the error (conformance.verdict.systematic); None without a delta to fit
    delta_bias: float | None = None  # α: the error's least-squares multiple of the delta
    delta_bias_se: float | None = None  # SE(α) under the rounding noise model
    delta_bias_threshold: float | None = None  # max(min_bias, z · SE(α)): |α| above it is flagged
    systematic_ratio: float | None = None  # |α| / threshold: ≤ 1 passes
    baseline_delta_bias: float | None = None  # the baseline's α on the same case
    # the error's spread (conformance.verdict.precision); None in a float32 output
    error_rms: float | None = None  # RMS of the error beyond each row's multiple of its delta
    expected_rms: float | None = None  # the RMS correct rounding in the dtype gives
    precision_ratio: float | None = None  # error_rms / expected_rms
    precision_threshold: float | None = None  # flagged above it; None where too few elements to judge
    # equal values with other bits where nothing may change (the untouched output, the inputs): recorded, not failed
    bit_differences: tuple[BitDifferences, ...] = ()

    def to_json(self) -> dict:
        numbers = {f.name: json_number(getattr(self, f.name)) for f in fields(self) if f.name != "bit_differences"}
        return {**numbers, "bit_differences": [entry.to_json() for entry in self.bit_differences]}


@dataclass(frozen=True)
class Problem:
    kind: FailureKind
    text: str
    rows: tuple[int, ...] = ()  # output rows (dim −2) where it shows, so messages can name their slots
    columns: tuple[int, ...] = ()  # output columns (dim −1) where it shows, so results can name their slices
    planes: tuple[int, ...] = ()  # indices over the dims before −2, flattened (a shrink buffer's slice)
    zeroed: bool = False  # written outside the region: every element it changed there is now zero


@dataclass(frozen=True)
class Verdict:
    problems: tuple[Problem, ...]
    measurement: Measurement | None

    @property
    def passed(self) -> bool:
        return not self.problems


def judge(
    actual: torch.Tensor,
    oracle: torch.Tensor,
    baseline: torch.Tensor,
    initial: torch.Tensor,
    written: torch.Tensor,
    delta: torch.Tensor | None = None,
    magnitude: torch.Tensor | None = None,
    rounding_dtype: torch.dtype | None = None,
) -> Verdict:
    # The dtype whose rounding the result carries: the output's, or a narrower one the op rounds its delta to before
    # it adds it to a wider output (vLLM 0.34's DeepSeek-V4 compressor: a bf16 delta into a float32 output), whose
    # budget, cap and rules then apply (OpSpec.delta_in_case_dtype).
    dtype = rounding_dtype or actual.dtype
    if actual.shape != oracle.shape or actual.dtype != initial.dtype:
        problem = (
            f"output has shape {tuple(actual.shape)} and dtype {actual.dtype}; "
            f"expected {tuple(oracle.shape)} and {initial.dtype}"
        )
        return Verdict((Problem(FailureKind.WRONG_OUTPUT_TYPE, problem),), None)

    problems: list[Problem] = []
    untouched = compare_values(actual, initial)
    outside = untouched.changed & ~written
    if outside.any():
        # zeros where values must stay (a kernel that zeroes the whole output, or its rows without adapter) say so
        zeroed = bool((actual[outside] == 0).all())
        verb = "zeroed" if zeroed else "wrote"
        problems.append(Problem(FailureKind.OUTSIDE_REGION, f"{verb} {int(outside.sum())} element(s) it must leave untouched",
                                **where(outside), zeroed=zeroed))
    bit_differences = BitDifferences.of(untouched, OUTPUT, OUTPUT, ~written)

    a, o, b = actual[written].double(), oracle[written].double(), baseline[written].double()
    nonfinite = torch.zeros_like(written)
    nonfinite[written] = ~torch.isfinite(a) & torch.isfinite(o)
    if nonfinite.any():
        problems.append(Problem(FailureKind.NAN_INF, f"{int(nonfinite.sum())} NaN/Inf element(s) where the oracle is finite", **where(nonfinite)))

    finite = torch.isfinite(a) & torch.isfinite(o)
    a, o, b = a[finite], o[finite], b[finite]
    tol = tolerance_for(dtype)
    scale = float(o.abs().max()) if o.numel() else 0.0
    scale = scale if scale > 0 else 1.0
    error = max_abs_error(a, o)
    baseline_error = max_abs_error(b, o)
    d = m = None
    if delta is not None:
        d = delta[written].double()[finite]
    if magnitude is not None:
        m = magnitude[written].double()[finite]
    operands = max(_largest((o - d).abs() + d.abs()), scale) if d is not None else scale  # |base| + |delta|
    terms = _largest(m) if m is not None else None
    # float32 accumulation inside the dot products, in ulps of their terms (any output dtype)
    accumulation = tol.accumulation_ulps * torch.finfo(torch.float32).eps * terms if terms is not None else 0.0
    floor = tol.floor_ulps * torch.finfo(dtype).eps * operands + accumulation
    budget = tol.k * baseline_error + floor
    cap = tol.rtol * operands + accumulation
    rows = row_groups(written)[finite]
    systematic = _systematic(a, o, b, d, m, rows, dtype) if d is not None else None
    spread = error_precision(a, o, b, d, m, rows, dtype)
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
        operand_scale=operands,
        magnitude_scale=terms,
        **(systematic.fields() if systematic else {}),
        **(spread.fields() if spread else {}),
        bit_differences=(bit_differences,) if bit_differences else (),
    )
    if error > budget or error > cap:
        which = f"{tol.k:g}× the baseline error {baseline_error:.3g} + floor {floor:.3g}" if error > budget else f"rtol cap {cap:.3g}"
        elementwise = torch.zeros(written.shape, dtype=torch.float64)
        elementwise[written] = (actual[written].double() - oracle[written].double()).abs().nan_to_num(0.0)
        text = f"max error {error:.3g} exceeds {which} (ratio {measurement.budget_ratio:.3g})"
        if not bitwise_differences(actual, initial)[written].any():  # bit for bit: did anything arrive at all
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
        problems.append(Problem(kind, text, **where(elementwise > min(budget, cap))))
    else:
        # Only inside the budget: a result outside it already fails for its written region, and keeps
        # the kinds it had (an expectations entry that lists ``numerics`` still covers it).
        if systematic and systematic.flagged:
            problems.append(Problem(FailureKind.SYSTEMATIC, systematic.text()))
        if spread and spread.flagged:  # the spread beyond the delta's multiple: independent of a gain
            problems.append(Problem(FailureKind.PRECISION, spread.text()))
    return Verdict(tuple(problems), measurement)


def _largest(values: torch.Tensor) -> float:
    """The largest finite value (0 if none): a −inf logit's magnitude says nothing of the terms."""
    values = values[torch.isfinite(values)]
    return float(values.max()) if values.numel() else 0.0


@dataclass(frozen=True)
class _Systematic:
    """The target's and the baseline's bias on one case, and the threshold of the output dtype.

    Flagged when the target's bias is past the threshold both from the correctly rounded oracle and
    from the baseline's bias: a bias the baseline has on the same inputs is one that rounding them
    correctly gives (rounding the products of a rank-1 delta whose LoRA-B entry lies just below a
    power of two moves every row the same way, by up to −0.45 u), not the target's."""

    target: DeltaBias
    baseline: DeltaBias | None
    threshold: float
    min_bias: float
    z: float

    @property
    def excess(self) -> float:
        """``min(|α|, |α − α_baseline|)``: the bias beyond both the correct result and the baseline's."""
        return min(abs(self.target.bias), abs(self.target.bias - self.baseline.bias)) if self.baseline else abs(self.target.bias)

    @property
    def flagged(self) -> bool:
        return self.excess > self.threshold

    def fields(self) -> dict:
        return {
            "delta_bias": self.target.bias,
            "delta_bias_se": self.target.standard_error,
            "delta_bias_threshold": self.threshold,
            "systematic_ratio": self.excess / self.threshold,
            "baseline_delta_bias": self.baseline.bias if self.baseline else None,
        }

    def text(self) -> str:
        baseline = _percent(self.baseline.bias, "+") if self.baseline else "undefined"
        return (
            f"systematic error in the delta: the error is {_percent(self.target.bias, '+')} of the LoRA delta "
            f"({self.target.significance:.1f} standard errors of rounding; the baseline's bias is {baseline}), "
            f"past the threshold {_percent(self.threshold)} = max(min bias {_percent(self.min_bias)}, "
            f"{self.z:g} × SE {_percent(self.target.standard_error)}) from both"
        )


def _percent(fraction: float, sign: str = "") -> str:
    """Three significant digits, in percent: float16's biases are hundredths of a percent."""
    return f"{fraction * 100:{sign}.3g}%"


def _systematic(a, o, b, d, m, rows, dtype: torch.dtype) -> _Systematic | None:
    """The bias along the delta ``d`` of the result ``a``'s error and of the baseline ``b``'s (1-D, over
    the written elements where the result and the oracle ``o`` are finite; ``m`` the magnitude there, or
    None), and the dtype's threshold; None where the delta is zero (nothing to be proportional to)."""
    nearest = correctly_rounded(o, dtype)  # every correct result's error along d includes the oracle's own rounding
    target = delta_bias(a - nearest, d, o, rows, dtype, m)
    if target is None:
        return None
    baseline = delta_bias((b - nearest).nan_to_num(0.0, 0.0, 0.0), d, o, rows, dtype, m)  # a baseline that overflowed
    rule = systematic_threshold_for(dtype)
    return _Systematic(target, baseline, max(rule.min_bias, rule.z * target.standard_error), rule.min_bias, rule.z)
