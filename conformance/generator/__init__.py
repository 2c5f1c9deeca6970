"""The case generator: Hypothesis strategies per op × dtype × family, and the profiles built from them."""

from .families import FAMILIES, Family, families_for
from .limits import Limits
from .profiles import DEFAULT_PROFILE, PROFILES, Profile, profile_cases

# ``cases`` and ``draw_examples`` need Hypothesis, which takes seconds to import; a run whose profile
# is in the disk cache (conformance.generator.cache) never draws, so they load on first use.
_LAZY = {"cases": ".strategies", "draw_examples": ".drawing"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_PROFILE",
    "FAMILIES",
    "PROFILES",
    "Family",
    "Limits",
    "Profile",
    "cases",
    "draw_examples",
    "families_for",
    "profile_cases",
]
