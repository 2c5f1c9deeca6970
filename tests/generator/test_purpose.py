"""Every case tests what it claims: each family's guarantee over the release profile's cases.

A family steers the draw to its corner, but the kernels read a corner only on a row an adapter serves
(``conformance.cases.features.served_slots``). ``GUARANTEES`` are those of docs/cases.md, *What every
case exercises*, as data: which cases each applies to and what must hold of them. One test holds them
all over the largest profile (run seed 0, drawn once: a single test, so parallel workers do not both
draw it), naming every case that lost its purpose, so a change to a family or to the strategy that
lets a case test less than it claims fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from test_generator import expected_feature  # the feature a family names, as its op can show it

from conformance.cases import Case
from conformance.cases.features import LONG_BATCH, case_features, served_slots
from conformance.cases.scales import exact_in
from conformance.generator.families import FAMILIES
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS


@dataclass(frozen=True)
class Guarantee:
    name: str
    applies: Callable[[Case], bool]
    holds: Callable[[Case], bool]


def _served_ranks(case: Case) -> list[int]:
    return [case.adapter_ranks[slot] for slot in served_slots(case)]


def _family(*names: str) -> Callable[[Case], bool]:
    return lambda case: case.family in names


GUARANTEES = (
    Guarantee("serves a row (every family but allneg1)", lambda c: FAMILIES[c.family].serves, lambda c: bool(served_slots(c))),
    Guarantee("allneg1 serves none", _family("allneg1"), lambda c: not served_slots(c)),
    Guarantee("exercises its family's feature", lambda c: expected_feature(c) is not None, lambda c: expected_feature(c) in case_features(c)),
    Guarantee("rank_512 serves a rank above 256", _family("rank_512"), lambda c: any(r > 256 for r in _served_ranks(c))),
    Guarantee("rank_max serves rank 256", _family("rank_max"), lambda c: 256 in _served_ranks(c)),
    Guarantee("rank_odd serves a rank no multiple of 16", _family("rank_odd"), lambda c: any(r % 16 for r in _served_ranks(c))),
    Guarantee("rank_padded serves a rank below the stack's", _family("rank_padded"), lambda c: any(r < c.max_rank for r in _served_ranks(c))),
    Guarantee("last_slot serves slot L−1", _family("last_slot"), lambda c: c.num_slots - 1 in served_slots(c)),
    Guarantee("a long batch serves rows past 2,048", _family("long_batch", "long_sampled"),
              lambda c: len(OP_SPECS[c.op].row_slots(c)) > LONG_BATCH and "long_batch" in case_features(c)),
    Guarantee("a long MoE batch routes more than 4,096 pairs", lambda c: c.family == "long_batch" and c.is_moe,
              lambda c: c.num_tokens * c.top_k > 4096),
)  # fmt: skip


@pytest.mark.slow  # draws the release profile (minutes of CPU without the disk cache)
def test_every_release_case_exercises_what_its_family_claims():
    cases = profile_cases("release")
    applied = {g.name: [(i, c) for i, c in cases if g.applies(c)] for g in GUARANTEES}
    assert all(applied.values()), [name for name, some in applied.items() if not some]  # every guarantee is tested
    lacking = {name: [i for i, c in some if not g.holds(c)][:10] for g, (name, some) in zip(GUARANTEES, applied.items())}
    assert {name: ids for name, ids in lacking.items() if ids} == {}
    # release reaches past 8,192 pairs in every MoE op that gets long batches
    routed = [c for _, c in cases if c.family == "long_batch" and c.is_moe]
    assert {c.op for c in routed if c.num_tokens * c.top_k > 8192} == {c.op for c in routed}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_most_scaled_cases_carry_a_scale_the_dtype_does_not_hold(dtype):
    scales = [c.scale for _, c in profile_cases("standard", dtypes=(dtype,)) if c.scale != 1.0]
    inexact = [s for s in scales if not exact_in(s, getattr(torch, dtype))]
    assert scales and len(inexact) > len(scales) / 2, f"{len(inexact)} of {len(scales)} scaled {dtype} cases"


def test_the_guarantees_fail_a_case_that_lost_its_purpose():
    """The checks can fail: a rank_512 case whose served slot has a small rank, a random one with every row at −1."""
    case = next(c for _, c in profile_cases("smoke", ops=("lora_shrink",), dtypes=("bfloat16",)) if c.family == "rank_512")
    served = sorted(served_slots(case))
    small = replace(case, adapter_ranks=tuple(1 if slot in served else r for slot, r in enumerate(case.adapter_ranks)))
    by_name = {g.name: g for g in GUARANTEES}
    assert not by_name["rank_512 serves a rank above 256"].holds(small)
    assert not by_name["exercises its family's feature"].holds(small)
    unserved = replace(case, family="random", seq_slots=(-1,) * len(case.seq_slots))
    assert not by_name["serves a row (every family but allneg1)"].holds(unserved)
