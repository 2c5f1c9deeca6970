"""Judging generations: a target's against the reference's, or a target's against its own elsewhere.

Frozen expected strings would be wrong: in low precision, batch position alone can flip a greedy
token where two candidates are nearly tied. So the rules are stated against the reference's own
uncertainty, per dtype (the table below is data):

* teacher-forced logits: at every position the target's top-1 must be the reference's wherever the
  reference's top-2 margin exceeds ``near_tie``, and the log-probability of the fed token must be within
  ``logprob_error`` of the reference's;
* free-running greedy: tokens identical up to the first position where the reference's margin is at
  most ``near_tie`` (after such a near-tie both continuations are right, and they are compared no further);
* invariance (batch, order): the same request run by the target in two batches must satisfy both rules
  against itself (teacher-forced on the reference's continuation, and greedy), with the smaller of the
  two runs' margins deciding what is a near-tie;
* MoE routing: a router's choice is discrete, so where the reference's k-th and (k+1)-th router logits
  (at the token a position is computed from, in any layer) are within ``router_near_tie``, either
  expert is right and the position is a near-tie too: teacher forcing skips it, greedy stops there.

Every problem names the request and shows both continuations as text and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.verdict import FailureKind

from .generation import Generation


@dataclass(frozen=True)
class GenerationTolerance:
    near_tie: float  # top-2 log-prob margin at or below which either token is a right answer
    logprob_error: float  # largest allowed |log p_target − log p_reference| of a scored token
    router_near_tie: float  # router logit gap (k-th to (k+1)-th) at or below which either expert is right


# Calibrated on the fixture models (docs/e2e.md): the largest log-prob error of a correct target (the
# suite's decoder on hpu-emulated, vLLM's CPU engine on its adapter requests) was 7e-6 in float32, 0.017
# in float16 and 0.19 in bfloat16, a quarter of the bounds below or less; float32 keeps room for TF32 on
# GPUs. vLLM's −1 bug moves log-probs by 0.04 to 20 and flips tokens with margins above 1. The largest
# router logit error of a correct target on the MoE model was 6e-6, 0.017 and 0.13: the router near-ties
# are about twice that (two logits move), float32 again with room for TF32.
GENERATION_TOLERANCES: dict[str, GenerationTolerance] = {
    "float32": GenerationTolerance(near_tie=0.01, logprob_error=0.01, router_near_tie=0.02),
    "float16": GenerationTolerance(near_tie=0.1, logprob_error=0.1, router_near_tie=0.05),
    "bfloat16": GenerationTolerance(near_tie=0.5, logprob_error=0.75, router_near_tie=0.25),
}


@dataclass(frozen=True)
class Problem:
    request_index: int
    generation: Generation
    message: str
    kinds: frozenset[FailureKind]


class Comparison:
    """Compares generations of one dtype; ``decode`` turns token ids into text for messages.

    ``expected`` is the reference's generation, or for the invariance checks the same request's
    generation by the same target in another batch (``against`` names which, for messages). Against
    the reference only the reference's margins decide what is a near-tie; between two runs of the
    target the smaller of the two margins does (output and routing margins alike).
    """

    def __init__(self, dtype: str, decode) -> None:
        self.tolerance = GENERATION_TOLERANCES[dtype]
        self.decode = decode

    def show(self, tokens) -> str:
        return f"{self.decode(list(tokens))!r} {list(tokens)}"

    def scores(self, index: int, got: Generation, expected: Generation, against: str = "the reference") -> list[Problem]:
        """Teacher-forced: both scored the same continuation; compare top-1 and log-probabilities."""
        if wrong_length := self._length(index, got, expected):
            return wrong_length
        tol, problems, kinds = self.tolerance, [], set()
        for position, (mine, theirs) in enumerate(zip(got.steps, expected.steps)):
            if self._routing_tie(mine, theirs, against):
                continue
            top1, their_top1 = mine.top[0][0], theirs.top[0][0]
            margin = self._margin(mine, theirs, against)
            if top1 != their_top1 and margin > tol.near_tie:
                kinds.add(FailureKind.TOKENS)
                problems.append(f"position {position}: top-1 {self.show([top1])} where {against} has "
                                f"{self.show([their_top1])} (margin {margin:.3g} > {tol.near_tie})")
            error = abs(mine.logprob - theirs.logprob)
            if not error <= tol.logprob_error:
                kinds.add(FailureKind.NUMERICS)
                problems.append(f"position {position}: log p({self.show([theirs.token])}) = {mine.logprob:.4g}, "
                                f"{against} {theirs.logprob:.4g} (error {error:.3g} > {tol.logprob_error})")
        if not problems:
            return []
        headline = f"teacher-forced on the continuation {self.show(expected.tokens)}, compared with {against}"
        shown = "\n    ".join(problems[:4]) + (f"\n    … {len(problems) - 4} more" if len(problems) > 4 else "")
        return [Problem(index, got, f"{self._headline(got, headline)}\n    {shown}", frozenset(kinds))]

    def greedy(self, index: int, got: Generation, expected: Generation, against: str = "the reference") -> list[Problem]:
        """Free-running: tokens identical up to the first near-tie."""
        if wrong_length := self._length(index, got, expected):
            return wrong_length
        step = next((i for i, (a, b) in enumerate(zip(got.tokens, expected.tokens)) if a != b), None)
        if step is None or step >= self._judged(got, expected, against):
            return []
        margin = self._margin(got.steps[step], expected.steps[step], against)
        if margin <= self.tolerance.near_tie:
            return []
        headline = f"greedy output diverges from {against} at step {step} (top-2 margin {margin:.3g} > {self.tolerance.near_tie})"
        return [Problem(index, got, f"{self._headline(got, headline)}\n    target:    {self.show(got.tokens)}"
                                    f"\n    {against}: {self.show(expected.tokens)}", frozenset({FailureKind.TOKENS}))]

    def max_logprob_error(self, got: list[Generation], expected: list[Generation], common_prefix: bool = False) -> float:
        """Largest |log p| difference over the judged positions where both scored the same token (and,
        with ``common_prefix``, greedy, the same past); routing near-ties are not judged."""
        worst = 0.0
        for mine, theirs in zip(got, expected):
            for position, (a, b) in enumerate(zip(mine.steps, theirs.steps)):
                if common_prefix and (a.token != b.token or position >= self._judged(mine, theirs)):
                    break
                if a.token == b.token and not self._routing_tie(a, b):
                    worst = max(worst, abs(a.logprob - b.logprob))
        return worst

    @staticmethod
    def _margin(mine, theirs, against: str, kind: str = "margin") -> float:
        """The reference's margin (output or ``routing_margin``), or between two runs the smaller one."""
        return getattr(theirs, kind) if against == "the reference" else min(getattr(mine, kind), getattr(theirs, kind))

    def _routing_tie(self, mine, theirs, against: str = "the reference") -> bool:
        return self._margin(mine, theirs, against, "routing_margin") <= self.tolerance.router_near_tie

    def _judged(self, got: Generation, expected: Generation, against: str = "the reference") -> int:
        """Greedy positions before the first routing near-tie (all of them without a router)."""
        pairs = enumerate(zip(got.steps, expected.steps))
        return next((i for i, (a, b) in pairs if self._routing_tie(a, b, against)), len(expected.steps))

    def _length(self, index: int, got: Generation, expected: Generation) -> list[Problem]:
        if len(got.steps) == len(expected.steps):
            return []
        what = f"returned {len(got.steps)} positions, expected {len(expected.steps)}"
        return [Problem(index, got, self._headline(got, what), frozenset({FailureKind.WRONG_OUTPUT_TYPE}))]

    @staticmethod
    def _headline(got: Generation, what: str) -> str:
        return f"request {got.request.describe()}: {what}"
