"""The verdict: how a result is judged against the oracle and the low-precision baseline."""

from .failure_kind import FailureKind
from .judge import Measurement, Problem, Verdict, judge
from .outcome import Outcome
from .tolerances import TOLERANCES, Tolerance, tolerance_for

__all__ = ["TOLERANCES", "FailureKind", "Measurement", "Outcome",
    "Problem", "Tolerance", "Verdict", "judge", "tolerance_for"]
