"""Profiles: how many cases of each op × dtype × family a run holds, and how big they may be.

* ``smoke``: one random case per op × dtype × applicable family; about a minute on 2 cores. Its long
  batches stay just above 2,048 rows (``Limits.long_batch``).
* ``standard`` (default): the simplest and four random cases per combination, larger sizes (5,000+
  op cases, batches of up to 8,192 rows, ranks up to 512; within 5 minutes with ``-n 2`` on 2 cores,
  docs/profiles.md, docs/benchmarks-suite.md).
* ``release``: ten per combination, release-size shapes (8k tokens, ranks up to 512); shard it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from conformance.cases.case import DTYPES, Case
from conformance.ops import OP_SPECS

from .cache import cached_cases, drawn_spec_fields
from .families import FAMILIES, families_for
from .limits import RELEASE_LIMITS, SMOKE_LIMITS, STANDARD_LIMITS, Limits


@dataclass(frozen=True)
class Profile:
    name: str
    per_combination: int
    limits: Limits
    include_simplest: bool  # keep Hypothesis' simplest example of each combination
    doc: str
    # Seconds a case may run before it is stopped and recorded "timed out" (--case-timeout overrides).
    # Far above any correct case (the slowest, the first end-to-end case of a vLLM target, builds its
    # engine in ~10-30 s on 2 cores), so only a hang reaches it; larger shapes get more.
    case_timeout: float


PROFILES = {
    p.name: p
    for p in (
        Profile("smoke", 1, SMOKE_LIMITS, False, "every op × dtype × edge-case family once", case_timeout=300),
        Profile("standard", 5, STANDARD_LIMITS, True, "five cases per op × dtype × family", case_timeout=600),
        Profile("release", 10, RELEASE_LIMITS, True, "ten cases per op × dtype × family at release sizes", case_timeout=1800),
    )
}
DEFAULT_PROFILE = "standard"


def _combination_seed(run_seed: int, *parts: str) -> int:
    """A seed per combination that does not move when other ops or families are added."""
    return zlib.crc32("/".join(parts).encode()) ^ run_seed


def profile_cases(
    profile: Profile | str,
    run_seed: int = 0,
    ops: tuple[str, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
) -> list[tuple[str, Case]]:
    """The ``(case id, case)`` pairs of a profile, in a fixed order, ids unique."""
    if isinstance(profile, str):
        profile = PROFILES[profile]
    return cached_cases(profile_key(profile, run_seed, ops, dtypes), lambda: _draw_profile(profile, run_seed, ops, dtypes))


def profile_key(profile: Profile, run_seed: int, ops: tuple[str, ...] | None, dtypes: tuple[str, ...] | None) -> dict:
    """What a drawing of ``profile`` reads besides the code (``cache.DRAWING_SOURCES``): the profile, the seed,
    the filters, the families there are, and the drawing-relevant fields of the spec of every op drawn
    (in drawing order, so that an op registered or removed changes the key)."""
    return {
        "profile": profile.name,
        "seed": run_seed,
        "ops": ops,
        "dtypes": dtypes,
        "families": list(FAMILIES),
        "specs": [drawn_spec_fields(OP_SPECS[op]) for op in ops or tuple(OP_SPECS)],
    }


def _draw_profile(profile: Profile, run_seed: int, ops, dtypes) -> list[tuple[str, Case]]:
    # imported here: they need Hypothesis, which a run served from the disk cache never imports
    from .drawing import draw_examples
    from .strategies import cases

    chosen: list[tuple[str, Case]] = []
    seen: dict[str, int] = {}
    for op in ops or tuple(OP_SPECS):
        spec = OP_SPECS[op]
        for dtype in dtypes or tuple(DTYPES):
            for family in families_for(spec, dtype):
                strategy = cases(spec, dtype, family.name, profile.limits)
                combination_seed = _combination_seed(run_seed, op, dtype, family.name)
                drawn = draw_examples(strategy, profile.per_combination, combination_seed, profile.include_simplest)
                for case in drawn:
                    base = case.case_id
                    seen[base] = seen.get(base, 0) + 1
                    chosen.append((base if seen[base] == 1 else f"{base};draw={seen[base]}", case))
    return chosen
