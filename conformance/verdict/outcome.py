"""The result vocabulary, CTS-style: what a case can end as, and which endings the gate accepts."""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"  # numerics: outside the error budget, wrote where it must not, NaN/Inf
    BROKEN = "broken"  # the target raised or crashed
    NOT_SUPPORTED = "not supported"  # declared by the target, or an op it does not define
    KNOWN_FAILURE = "known failure"  # failed as an expectations entry says it will
    UNEXPECTED_PASS = "unexpected pass"  # an expectations entry says it fails, yet it passed (strict)

    @property
    def accepted_by_gate(self) -> bool:
        return self in (Outcome.PASS, Outcome.NOT_SUPPORTED, Outcome.KNOWN_FAILURE)

    @property
    def ran(self) -> bool:
        """Whether the target actually executed the case."""
        return self is not Outcome.NOT_SUPPORTED
