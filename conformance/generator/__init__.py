"""The case generator: Hypothesis strategies per op × dtype × family, and the profiles built from them."""

from .drawing import draw_examples
from .families import FAMILIES, Family, families_for
from .limits import Limits
from .profiles import DEFAULT_PROFILE, PROFILES, Profile, profile_cases
from .strategies import cases

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
