"""Drawing a reproducible list of examples from a Hypothesis strategy.

Profiles are lists of cases fixed at collection time (every xdist worker must collect the same
ones), so they are drawn by running Hypothesis' generate phase with an explicit seed and no example
database. Hypothesis tries the simplest possible example first: a profile may keep it (the smallest
case of a family is the easiest to debug) or skip it for one more random draw.
"""

from __future__ import annotations

from typing import TypeVar

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.strategies import SearchStrategy

from conformance.compat import without_hypothesis_local_constants

T = TypeVar("T")


def draw_examples(strategy: SearchStrategy[T], count: int, draw_seed: int, include_simplest: bool = True) -> list[T]:
    """``count`` examples of ``strategy`` (fewer if it has fewer distinct ones), the same for a seed."""
    drawn: list[T] = []
    skip = 0 if include_simplest else 1

    @seed(draw_seed)
    @settings(
        max_examples=count + skip,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: T) -> None:
        drawn.append(example)

    with without_hypothesis_local_constants():  # the same cases in every process
        collect()
    return drawn[skip:]
