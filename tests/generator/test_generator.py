"""Statistics of the case generator: do the profiles reach the corners they promise?

The conformance suite is only as good as the cases it draws. These tests check, on the real smoke
and standard profiles, that every edge-case family is drawn for every op × dtype and really shows its
feature; that the ``random`` family mixes the knobs at useful rates; that the standard profile reaches
the sizes and flags vLLM's own tests miss (docs/vllm-lora-ops.md §7.5, "Not covered"); that
drawing is deterministic; and that a case survives its JSON round trip.

Drawing a profile costs seconds, so each profile is drawn once per module (``profile_cases`` may
serve it from its disk cache, keyed by what the drawing reads: test_profile_cache.py); the determinism
tests turn the cache off, since with it any two calls would agree.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.cases import DTYPES, ODD_HIDDEN_SIZES, REAL_HIDDEN_SIZES, Case, case_features
from conformance.cases.features import LARGE_T, LONG_BATCH, served_slots
from conformance.generator import FAMILIES, PROFILES, cases, draw_examples, families_for, profile_cases
from conformance.ops import OP_SPECS
from conformance.ops.kernel import shrink_written

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke() -> list[tuple[str, Case]]:
    return profile_cases("smoke")


@pytest.fixture(scope="module")
def standard() -> list[tuple[str, Case]]:
    return profile_cases("standard")


PROFILE_NAMES = ("smoke", "standard")


@pytest.fixture(params=PROFILE_NAMES)
def profile(request) -> list[tuple[str, Case]]:
    return request.getfixturevalue(request.param)


# -- (a) every family, every op × dtype, and each case shows its family's feature ----------------


def test_every_applicable_family_is_drawn_for_every_op_and_dtype(profile):
    drawn = Counter((case.op, case.dtype, case.family) for _, case in profile)
    missing = [
        (op, dtype, family.name)
        for op, spec in OP_SPECS.items()
        for dtype in DTYPES
        for family in families_for(spec, dtype)
        if not drawn[op, dtype, family.name]
    ]
    assert not missing
    # … and nothing else: a family that needs a knob (bias, offset …) is never drawn for an op that
    # does not read that knob, where its cases would silently be plain random ones.
    strays = {(c.op, c.family) for _, c in profile if not FAMILIES[c.family].needs_knobs <= OP_SPECS[c.op].knobs}
    assert not strays


# Ops whose output is the [S, T, R] shrink buffer (lora_shrink, add_shrink, …).
SHRINK_BUFFER_OPS = frozenset(op for op, spec in OP_SPECS.items() if spec.written_mask is shrink_written)


def expected_feature(case: Case) -> str | None:
    """The feature a case of its family must show, or None where the op cannot express it."""
    feature = FAMILIES[case.family].feature
    if feature == "unequal_slices" and case.op in SHRINK_BUFFER_OPS:
        # These ops read the slice count, never the slice widths, so the family shows as several slices.
        return "multi_slice"
    return feature


def test_each_case_shows_the_feature_of_its_family(profile):
    lacking = [
        (case_id, expected_feature(case))
        for case_id, case in profile
        if expected_feature(case) is not None and expected_feature(case) not in case_features(case)
    ]
    assert not lacking


# -- (b) the random family mixes the knobs -------------------------------------------------------

# Ops that together read every knob (shrink, expand, slices, offset, bias, scale, expand input).
RANDOM_OPS = ("bgmv_shrink", "sgmv_expand_slice", "lora_expand", "add_expand", "add_lora_linear", "add_lora_logits")
RANDOM_DRAWS = 100

# Feature → (knob an op must read for the feature to be possible, minimum rate over those ops).
# Rates measured with seed 0, 100 draws per op, pooled over the ops that read the knob: neg1 .23,
# last_slot .22, noncontig .17, unequal_seqs .53, w4d .27, positive .27, multi_slice .25,
# no_add_inputs .75, scaled .19, fp32_input .27, bias .30, wide_output .22. Thresholds sit at about
# half of those, so a change that starves a knob fails while a reshuffle of draws does not.
RANDOM_RATES = {
    "neg1": (None, 0.10),
    "last_slot": (None, 0.10),
    "noncontig": (None, 0.08),
    "unequal_seqs": (None, 0.25),
    "w4d": (None, 0.12),
    "positive": (None, 0.12),
    "multi_slice": ("slices", 0.15),
    "no_add_inputs": ("add_inputs", 0.35),
    "scaled": ("scale", 0.08),
    "fp32_input": ("expand_input", 0.10),
    "bias": ("bias", 0.10),
    "wide_output": ("wide", 0.08),
}


@pytest.fixture(scope="module")
def random_cases() -> dict[str, list[Case]]:
    limits = PROFILES["standard"].limits
    return {op: draw_examples(cases(OP_SPECS[op], "bfloat16", "random", limits), RANDOM_DRAWS, 0) for op in RANDOM_OPS}


@pytest.mark.parametrize("feature", RANDOM_RATES)
def test_random_family_rates(random_cases, feature):
    knob, minimum = RANDOM_RATES[feature]
    ops = [op for op in RANDOM_OPS if knob is None or knob in OP_SPECS[op].knobs]
    drawn = [case for op in ops for case in random_cases[op]]
    rate = sum(feature in case_features(case) for case in drawn) / len(drawn)
    assert rate >= minimum, f"{feature}: {rate:.2f} of {len(drawn)} random cases of {ops}"
    # Every op that can show the feature shows it at least once, not only the pool as a whole.
    assert [op for op in ops if not any(feature in case_features(case) for case in random_cases[op])] == []


def test_random_family_serves_a_row_in_every_case(random_cases):
    # A batch without any adapter tests almost nothing: it is allneg1's, never random's.
    drawn = [case for op in RANDOM_OPS for case in random_cases[op]]
    assert not [case for case in drawn if not served_slots(case)]


# -- (c) the standard profile reaches the corners ------------------------------------------------


def test_standard_profile_token_counts(standard):
    counts = {case.num_tokens for _, case in standard}
    assert 1 in counts
    assert max(counts) >= LARGE_T >= 1024


def test_standard_profile_ranks(standard):
    max_ranks = {case.max_rank for _, case in standard}
    assert {1, 256, 320, 512} <= max_ranks  # 320 and 512: vLLM's max_lora_rank values above 256
    assert any(rank % 16 for rank in max_ranks), "no rank that is not a multiple of 16"
    assert any("rank_padded" in case_features(case) for _, case in standard), "no adapter below the max rank"


def test_standard_profile_sizes(standard):
    sizes = {size for _, case in standard for size in (case.hidden_size, case.output_width, *case.output_slices)}
    assert set(ODD_HIDDEN_SIZES) <= sizes, f"odd sizes never drawn: {sorted(set(ODD_HIDDEN_SIZES) - sizes)}"
    assert set(REAL_HIDDEN_SIZES) <= sizes, f"real sizes never drawn: {sorted(set(REAL_HIDDEN_SIZES) - sizes)}"
    assert {2049, 3424} <= sizes  # vLLM's test hidden size and an old "no suitable kernel" size


def test_standard_profile_slices(standard):
    shapes = {case.output_slices for _, case in standard if "unequal_slices" in case_features(case)}
    assert any(len(s) == 2 for s in shapes)
    assert any(len(s) == 3 and len(set(s)) == 3 for s in shapes), "no three slices of three widths (GQA q/k/v)"
    assert any(len(case.output_slices) == 1 for _, case in standard)


def test_standard_profile_flags(standard):
    found = set().union(*(case_features(case) for _, case in standard))
    assert {"offset", "no_add_inputs", "scaled", "fp32_input", "wide_output", "bias", "w4d", "decode"} <= found
    assert {case.add_inputs for _, case in standard} == {True, False}
    assert {case.dtype for _, case in standard} == set(DTYPES)
    fp32_input_dtypes = {case.dtype for _, case in standard if "fp32_input" in case_features(case)}
    assert fp32_input_dtypes == {"float16", "bfloat16"}
    assert any(case.scale != 1.0 for _, case in standard)


# -- (c2) ranks above 256 and batches above 2,048 rows (issue 23) -----------------------------------

LONG_FAMILIES = ("long_batch", "long_sampled")


def op_rows(case: Case) -> int:
    """The rows one call of the case's op handles: its sampled rows for the logits and heads, else its tokens."""
    return len(case.sampled_slots) if OP_SPECS[case.op].rows == "sampled" else case.num_tokens


def test_rank_512_draws_ranks_320_and_512_and_keeps_the_rest_small(profile):
    drawn = [case for _, case in profile if case.family == "rank_512"]
    # not the alignment, nor an op that names its own families without it (OpSpec.families: the fp8 ops)
    aimed = {op for op, spec in OP_SPECS.items() if spec.families is None or "rank_512" in spec.families}
    assert {case.op for case in drawn} == {op for op in aimed if OP_SPECS[op].check is None}
    assert {case.max_rank for case in drawn} == {320, 512}
    for case in drawn:
        assert case.num_slots <= 4 and case.hidden_size <= 64 and max(case.output_slices) <= 64
        assert case.num_experts <= 4


def test_standard_profile_draws_both_large_ranks_for_every_op(standard):
    ranks: dict[str, set[int]] = {}
    for _, case in standard:
        if case.family == "rank_512":
            ranks.setdefault(case.op, set()).add(case.max_rank)
    assert ranks and all(found == {320, 512} for found in ranks.values()), ranks


def test_every_op_gets_batches_beyond_2048_rows(profile):
    long = [case for _, case in profile if "long_batch" in case_features(case)]
    # every op but one that names its own families without a long one (OpSpec.families: the fp8 ops)
    assert {case.op for case in long} == {op for op, spec in OP_SPECS.items() if spec.families is None or set(LONG_FAMILIES) & set(spec.families)}
    assert all(op_rows(case) > LONG_BATCH for case in long)
    # only the long families reach them in smoke and standard; the rows beyond 2,048 read an adapter
    assert {case.family for case in long} == set(LONG_FAMILIES)
    assert all(case.seq_slots[-1] != -1 for case in long)


def test_long_batches_reach_8192_rows_with_small_other_sizes(standard):
    long = [case for _, case in standard if case.family in LONG_FAMILIES]
    routed = [case for case in long if case.is_moe]
    dense = [case for case in long if not case.is_moe]
    assert 6144 < max(op_rows(case) for case in dense) <= 8192
    # the MoE ops: two choices per token, so more than 4,096 pairs in every long MoE case (a 4,096-pair bucket shows)
    assert {case.top_k for case in routed} == {2}
    assert min(case.num_tokens * case.top_k for case in routed) > 4096
    assert 6144 < max(case.num_tokens for case in routed) <= 8192
    for case in long:
        assert case.max_rank <= 16 and case.num_slots <= 4 and case.num_experts <= 4, case
        assert case.hidden_size <= 32 and max(case.output_slices) <= 32, case


def test_smoke_long_batches_stay_just_above_4096_rows(smoke):
    """Past a 4,096-row bucket on every long-batch op (cheap shapes), not far past it: smoke stays fast."""
    rows = {case.op: op_rows(case) for _, case in smoke if case.family in LONG_FAMILIES}
    assert rows and min(rows.values()) > 4096 and max(rows.values()) <= PROFILES["smoke"].limits.long_batch[1], rows


def test_the_largest_long_moe_batch_fits_hypothesis_buffer():
    """A long MoE batch at its most tokens (8,192, two choices each: a drawn pattern repeated) draws within
    Hypothesis' choice buffer: were it to overrun, every such draw would be thrown away, and a combination left
    without one fails after minutes of retries."""
    from hypothesis.errors import StopTest
    from hypothesis.internal.conjecture.data import ConjectureData, Status

    from conformance.generator.families import LongBatch

    class Longest(LongBatch):
        name = "tests_longest_moe_batch"

        def sequence_lengths(self, draw, limits):
            high = limits.long_batch[1]
            return (high // 4,) * 3 + (high - 3 * (high // 4),)

    FAMILIES[Longest.name] = Longest()
    high = PROFILES["standard"].limits.long_batch[1]
    try:
        # the MoE ops long batches are drawn for (fused_moe_lora_fp8 takes the fp8 families only)
        for op in [op for op, spec in OP_SPECS.items() if "routing" in spec.knobs and spec.families is None]:
            data = ConjectureData(random=random.Random(0))
            try:
                case = data.draw(cases(OP_SPECS[op], "float32", Longest.name, PROFILES["standard"].limits))
            except StopTest:
                pytest.fail(f"{op}: a long MoE batch of {high} tokens overran Hypothesis' buffer")
            assert data.status is not Status.OVERRUN and case.num_tokens == high
    finally:
        del FAMILIES[Longest.name]


# -- (d) deterministic drawing, unique ids -------------------------------------------------------


def test_profile_ids_are_unique(profile):
    ids = [case_id for case_id, _ in profile]
    assert len(ids) == len(set(ids))


@pytest.fixture
def no_profile_cache(monkeypatch):
    """Draw for real: with the disk cache of drawn profiles any two calls would agree."""
    monkeypatch.setenv("LORA_CONFORMANCE_CACHE", "off")


SUBSET = {"ops": ("sgmv_expand_slice", "add_lora_logits"), "dtypes": ("bfloat16",)}


def test_profile_drawing_is_deterministic(standard, no_profile_cache):
    first = profile_cases("standard", **SUBSET)
    assert first == profile_cases("standard", **SUBSET)
    # Drawing fewer ops or dtypes must not move the others: each op × dtype × family has its own seed.
    assert first == [(i, c) for i, c in standard if c.op in SUBSET["ops"] and c.dtype in SUBSET["dtypes"]]


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_profile_drawing_does_not_depend_on_the_process(no_profile_cache, tmp_path):
    # Every xdist worker, every shard on another machine draws the profile itself: another
    # interpreter, with another hash seed and other local modules imported (Hypothesis may harvest
    # integer literals from those), must collect the very same cases.
    (tmp_path / "constants_bait.py").write_text(f"BAIT = {list(range(1, 400, 3))}\n")
    script = (
        f"import json, sys; sys.path.insert(0, {str(tmp_path)!r}); import constants_bait; "
        "from conformance.generator import profile_cases; "
        f"print(json.dumps([(i, c.to_json()) for i, c in profile_cases('standard', **{SUBSET!r})]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242", "LORA_CONFORMANCE_CACHE": "off"}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    elsewhere = json.loads(run.stdout.splitlines()[-1])
    here = json.loads(json.dumps([(i, c.to_json()) for i, c in profile_cases("standard", **SUBSET)]))
    assert elsewhere == here


def test_another_run_seed_draws_other_cases():
    ops, dtypes = ("bgmv_shrink",), ("float32",)
    assert profile_cases("smoke", 0, ops, dtypes) != profile_cases("smoke", 1, ops, dtypes)


# -- (e) JSON round trip -------------------------------------------------------------------------


def test_case_json_round_trip(smoke):
    for _, case in smoke[::25]:
        text = json.dumps(case.to_json())
        assert Case.from_json(json.loads(text)) == case


def test_from_json_names_an_unknown_field(smoke):
    data = smoke[0][1].to_json() | {"colour": "blue"}
    with pytest.raises(ValueError, match="unknown case field.*colour"):
        Case.from_json(data)


def test_from_json_names_a_missing_field(smoke):
    data = smoke[0][1].to_json()
    del data["hidden_size"]
    with pytest.raises(ValueError, match="missing field.*hidden_size"):
        Case.from_json(data)


def test_from_json_keeps_defaults_for_optional_fields(smoke):
    data = smoke[0][1].to_json()
    del data["family"]
    assert Case.from_json(data).family == "random"


# -- (f) the segment layout of the sgmv ops ------------------------------------------------------

SEGMENT_FAMILIES = ("seg_permuted", "seg_gaps")


def _row_slots_ignoring_starts(case: Case) -> list[int]:
    """The slot per row of an sgmv kernel that ignores b_seq_start_loc: slots repeated by length from row 0."""
    repeated = [slot for slot, n in zip(case.seq_slots, case.seq_lens) for _ in range(n)]
    return repeated + [-1] * (case.num_tokens - len(repeated))


def test_segment_families_are_drawn_for_the_sgmv_ops_only(profile):
    ops = {case.op for _, case in profile if case.family in SEGMENT_FAMILIES}
    assert ops == {"sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"}
    # every other family keeps the canonical layout, and its JSON does not mention it
    others = [case for _, case in profile if case.family not in SEGMENT_FAMILIES]
    assert all(case.canonical_segments and "seq_starts" not in case.to_json() for case in others)


def test_seg_permuted_cases_cover_every_row_without_slot_minus_one(profile):
    permuted = [case for _, case in profile if case.family == "seg_permuted"]
    assert permuted
    for case in permuted:
        assert all(case.covered_rows) and case.num_tokens == sum(case.seq_lens)
        assert -1 not in case.seq_slots
        # row 0 gets another adapter when the starts are ignored: no slot −1 needed to see the bug
        assert _row_slots_ignoring_starts(case)[0] != case.token_slots[0]


def test_seg_gaps_cases_leave_rows_uncovered_before_between_and_after(profile):
    gapped = [case for _, case in profile if case.family == "seg_gaps"]
    assert gapped
    for case in gapped:
        assert {"seg_gap", "seg_late_start", "uncovered_rows"} <= case_features(case)
        assert not case.covered_rows[-1], "no uncovered row after the last segment"
        assert _row_slots_ignoring_starts(case) != list(case.token_slots)
    # some without any slot −1, some listed out of row order, overwrites among the expands
    assert any(-1 not in case.seq_slots for case in gapped)
    assert any("seg_permuted" in case_features(case) for case in gapped)
    assert any(not case.add_inputs for case in gapped if case.op != "sgmv_shrink")


def _segment_case(**layout) -> Case:
    structure = {"seq_lens": (2, 3), "seq_slots": (0, -1), "num_slots": 2, "max_rank": 4, "adapter_ranks": (4, 4)}
    return Case(op="sgmv_shrink", dtype="float32", **structure, hidden_size=8, output_slices=(1,), output_width=1, **layout)


def test_a_segment_layout_gives_each_row_its_segment_slot():
    case = _segment_case(seq_starts=(5, 1), num_rows=8)  # segment 0 at rows 5–6, segment 1 at rows 1–3
    assert case.token_slots == (-1, -1, -1, -1, -1, 0, 0, -1)
    assert case.covered_rows == (False, True, True, True, False, True, True, False)
    assert case_features(case) >= {"seg_permuted", "seg_gap", "seg_late_start", "uncovered_rows", "neg1"}
    assert Case.from_json(json.loads(json.dumps(case.to_json()))) == case


def test_an_uncovered_row_is_not_a_slot_minus_one_row():
    case = replace(_segment_case(seq_starts=(0, 2), num_rows=6), seq_slots=(0, 1))  # row 5 uncovered
    assert case.token_slots == (0, 0, 1, 1, 1, -1)
    assert "neg1" not in case_features(case) and "uncovered_rows" in case_features(case)


def test_the_canonical_layout_written_out_shows_no_layout_feature():
    case = _segment_case(seq_starts=(0, 2), num_rows=5)
    assert case.canonical_segments and case.token_slots == _segment_case().token_slots
    assert not case_features(case) & {"seg_permuted", "seg_gap", "seg_late_start", "uncovered_rows"}


@pytest.mark.parametrize(
    ("layout", "problem"),
    [
        ({"seq_starts": (0,)}, "1 seq_starts but 2 seq_lens"),
        ({"seq_starts": (0, 1)}, "segments overlap"),
        ({"seq_starts": (0, 4)}, "outside the 5 rows"),
        ({"seq_starts": (0, 2), "num_rows": 4}, "outside the 4 rows"),
        ({"seq_starts": (-1, 2)}, "outside"),
        ({"num_rows": -3}, "num_rows must be ≥ 0"),
    ],
)
def test_an_impossible_layout_is_refused_naming_the_field(layout, problem):
    with pytest.raises(ValueError, match=problem):
        _segment_case(**layout)
