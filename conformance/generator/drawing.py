"""Drawing a reproducible list of examples from a Hypothesis strategy.

Profiles are lists of cases fixed at collection time (every xdist worker must collect the same
ones), so they are drawn by running Hypothesis' generate phase with an explicit seed and no example
database. Hypothesis tries the simplest possible example first: a profile may keep it (the smallest
case of a family is the easiest to debug) or skip it for one more random draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.strategies import SearchStrategy

T = TypeVar("T")


@contextlib.contextmanager
def without_local_constants() -> Iterator[None]:
    """Keep Hypothesis from mixing in constants read from whatever local modules this process imported.

    Hypothesis (≥ 6.13x) sometimes draws integer literals it finds in the user's own imported modules.
    Which modules those are differs between processes (a vendor's target, the tests that ran before),
    so the same seed would draw different cases on different workers and machines, and shards would
    not add up. Inside this block the pool of local constants is empty; Hypothesis' own global
    constants still apply. Older Hypothesis versions have no such pool: nothing to do then.
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        original, cache = providers._get_local_constants, providers.CONSTANTS_CACHE
    except (ImportError, AttributeError):  # pragma: no cover - older Hypothesis
        yield
        return
    cache.cache.clear()
    providers._get_local_constants = Constants
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.cache.clear()


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

    with without_local_constants():
        collect()
    return drawn[skip:]
