"""Every use of a private pytest or Hypothesis API, in one place, each failing loudly when it moves.

The suite needs one thing neither project offers publicly:

* :func:`without_hypothesis_local_constants`: Hypothesis (from the release that added
  ``hypothesis.internal.constants_ast``) mixes integer literals found in the user's own imported
  modules into what it draws. Which modules those are differs between processes (a vendor's target,
  tests that ran before), so one seed would draw different profiles on different xdist workers and
  machines, and shards would not add up. Inside this block that pool is empty.

When an internal has moved, it raises :class:`CompatError` naming the package version, what moved,
and what to do, instead of silently drawing other cases. (junit.xml, which once needed pytest's JUnit
writer, is now written from the results document: ``conformance.report.junit``.) The tests
(tests/test_compat.py) check that each patch takes effect with the pinned versions.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator


class CompatError(RuntimeError):
    """A private API of pytest or Hypothesis the suite relies on is not where it was."""


def _moved(package: str, what: str, consequence: str) -> CompatError:
    from importlib.metadata import version

    return CompatError(
        f"{package} {version(package)} no longer has {what}, which lora-conformance relies on ({consequence}); "
        f"install the version pinned in constraints/cpu.txt, or update conformance/compat.py for this release"
    )


@contextlib.contextmanager
def without_hypothesis_local_constants() -> Iterator[None]:
    """Draw with Hypothesis' pool of constants from local modules emptied (its global constants still apply).

    A Hypothesis without ``hypothesis.internal.constants_ast`` predates the pool: nothing to empty.
    """
    if importlib.util.find_spec("hypothesis.internal.constants_ast") is None:
        yield
        return
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    if not (hasattr(providers, "_get_local_constants") and hasattr(providers, "CONSTANTS_CACHE")):
        raise _moved(
            "hypothesis",
            "hypothesis.internal.conjecture.providers._get_local_constants / CONSTANTS_CACHE",
            "without emptying that pool, one seed draws different cases in different processes",
        )
    original, cache = providers._get_local_constants, providers.CONSTANTS_CACHE
    cache.cache.clear()
    providers._get_local_constants = Constants
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.cache.clear()
