"""Failure clusters separate causes by the knob values their failures depend on (``conformance.report.cluster_knobs``).

A target with three independent seeded bugs, run in-process on a few dense ops of the smoke profile:

* the expand ignores ``offset_start`` / ``slice_offset`` (writes from column 0): outside the region where
  the slice fits there, nothing written where the slice covers no column of it;
* with ``add_inputs=False`` the expand rewrites the whole output (zeros it first): rows without adapter,
  columns beyond the slice and the slices an earlier call wrote, so it shows as three different rows;
* the shrink output passes through the activation dtype: over budget on adapter rows, in float16 and
  bfloat16.

By kind and rows alone two of them share a cluster and one spreads over three. With the knob values the
report gives three clusters, one per cause, whose members are the cases that cause fails: each cause's
cases are computed by running the target with that one bug, never written down here.
"""

from __future__ import annotations

import pytest
from fault_targets import PlainTorchTarget, ShrinkStoresInInputDtype
from test_clusters import NUMERICS, OUTSIDE, case, failure, passed
from test_report import document, parse

from conformance.generator.profiles import profile_cases
from conformance.report import write_html_report
from conformance.report.clusters import add_clusters, cluster_failures, fits, signature
from conformance.runner import run_case

# a shrink (the dtype bug), the slice expands (offset_start) and the expands that take add_inputs
OPS = ("bgmv_shrink", "bgmv_expand_slice", "sgmv_expand", "sgmv_expand_slice", "lora_expand")


class OffsetStartIgnored(PlainTorchTarget):
    """The expand writes from column 0 whatever ``offset_start`` / ``slice_offset`` say (a kernel that adds
    the slice offset to the output pointer of slice 0 only, or never)."""

    name = "fault-offset-start-ignored"

    def bgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True):
        super().bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, slice_size, add_inputs)

    def sgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                          batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
        super().sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                                  batches, max_seq_length, token_nums, 0, slice_size, add_inputs)  # fmt: skip

    def slice_offsets(self, widths, offset_start):
        return super().slice_offsets(widths, 0)


class NoAddInputsRewritesWholeOutput(PlainTorchTarget):
    """With ``add_inputs=False`` the expand zeroes the whole output before it writes its rows (a kernel that
    stores a zero-initialised output tile instead of its slice of it)."""

    name = "fault-no-add-inputs-rewrites-output"

    def write_expand(self, out, delta, rows, offset, add_inputs):
        if not add_inputs:
            out.zero_()
        super().write_expand(out, delta, rows, offset, add_inputs)


CAUSES = (OffsetStartIgnored, NoAddInputsRewritesWholeOutput, ShrinkStoresInInputDtype)


class ThreeCauses(*CAUSES):
    name = "fault-three-causes"


def judged(target, cases) -> list[dict]:
    return [run_case(target, case, case_id, runs=1, second_attempt=False).to_json() for case_id, case in cases]


@pytest.fixture(scope="module")
def three_causes() -> tuple[list[dict], dict[str, set[str]]]:
    """The three-bug target's results, and the cases each one bug alone fails. A case the three-bug target
    passes is passed by each bug alone (each fault only adds to what the plain target does); the cases it
    fails are run again with each bug alone."""
    cases = profile_cases("smoke", ops=OPS)
    results = judged(ThreeCauses(), cases)
    failed = {r["id"] for r in results if r["outcome"] != "pass"}
    rerun = [(case_id, case) for case_id, case in cases if case_id in failed]
    fails_alone = {cause.name: {r["id"] for r in judged(cause(), rerun) if r["outcome"] != "pass"} for cause in CAUSES}
    assert set().union(*fails_alone.values()) == failed  # no failure comes from two bugs meeting
    return results, fails_alone


def clusters_whose_titles_fit(results: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """``cluster_failures(results)``, having checked that each member fits a description its cluster's title names."""
    clusters, membership = cluster_failures(results)
    for record in results:
        if record["id"] in membership:
            cluster = clusters[membership[record["id"]] - 1]
            assert any(fits(record, d["kind"], d["where"], cluster["family"]) for d in cluster["described"]), (record["id"], cluster["title"])
    return clusters, membership


def members(membership: dict[str, int]) -> dict[int, set[str]]:
    by_cluster: dict[int, set[str]] = {}
    for case_id, number in membership.items():
        by_cluster.setdefault(number, set()).add(case_id)
    return by_cluster


def test_three_seeded_causes_are_three_clusters_one_each(three_causes):
    results, fails_alone = three_causes
    clusters, membership = cluster_failures(results)
    by_cluster = members(membership)
    assert len(clusters) == len(CAUSES)
    for cause, failing in fails_alone.items():
        others = set().union(*(f for name, f in fails_alone.items() if name != cause))
        [number] = {membership[case_id] for case_id in failing - others}
        # a case two bugs fail (none in this profile so far) may sit with either
        assert failing - others <= by_cluster[number] <= failing, cause
    only_with = {cause: clusters[membership[min(failing)] - 1]["only_with"] for cause, failing in fails_alone.items()}
    assert "offset_start > 0" in only_with[OffsetStartIgnored.name]  # and columns beyond the written ones, to write outside
    assert only_with[NoAddInputsRewritesWholeOutput.name] == ["add_inputs=False"]
    assert only_with[ShrinkStoresInInputDtype.name] == ["dtype bfloat16 or float16"]


def test_every_member_fits_a_description_its_clusters_title_names(three_causes):
    """The rewrite bug's cluster holds rows without adapter, columns beyond the slice and adapter rows over
    budget: its title names each (before, it said "rows without adapter receive a delta" over all of them)."""
    results, _ = three_causes
    clusters, membership = clusters_whose_titles_fit(results)
    rewrite = clusters[membership[next(r["id"] for r in results if r["id"] in membership and r.get("kind") == OUTSIDE
                                       and -1 in r["failing_slots"])] - 1]
    assert len(rewrite["described"]) > 1 and " or " in rewrite["title"]


def test_without_knob_values_the_causes_would_mix(three_causes):
    """What the knob values are for: by kind and rows alone, the rewrite bug shows as three descriptions, two
    of them shared with another bug."""
    results, fails_alone = three_causes
    shown = {r["id"]: signature(r) for r in results if r["outcome"] != "pass"}  # (kind, where, family)
    by_cause = {cause: {shown[case_id] for case_id in failing} for cause, failing in fails_alone.items()}
    rewrite = by_cause.pop(NoAddInputsRewritesWholeOutput.name)
    assert len(rewrite) >= 3 and all(rewrite & others for others in by_cause.values())


def test_one_cause_over_many_knob_values_stays_one_cluster(three_causes):
    """The rewrite bug alone: several ops, dtypes, slice counts, offsets, kinds and rows, one cluster."""
    results, fails_alone = three_causes
    failing = fails_alone[NoAddInputsRewritesWholeOutput.name]
    alone = [r if r["id"] in failing or r["outcome"] == "pass" else {**r, "outcome": "pass"} for r in results]
    shown = [r for r in alone if r["id"] in failing]
    assert len({r["op"] for r in shown}) > 1 and len({r["dtype"] for r in shown}) > 1 and len({r["kind"] for r in shown}) > 1
    [cluster] = cluster_failures(alone)[0]
    assert cluster["count"] == len(failing) and cluster["only_with"] == ["add_inputs=False"]
    assert cluster["conditions"] == {"add_inputs": [False]}


# -- the rule on hand-made results --------------------------------------------------------------------------


def expand(case_id, outcome="fail", dtype="bfloat16", kinds=(OUTSIDE,), slots=(0,), **knobs) -> dict:
    made = {**case(slots=(0, 1)), "add_inputs": True, "offset_start": 0, "output_width": 16, **knobs}
    record = failure(case_id, "lora_expand", dtype=dtype, kinds=kinds, slots=slots, case=made)
    return record if outcome == "fail" else {**passed(case_id, "lora_expand"), "dtype": dtype, "case": made}


def test_a_knob_value_the_failures_are_confined_to_is_in_the_signature_and_the_title():
    failures = [expand(f"f{i}", add_inputs=False, dtype=("float16", "bfloat16", "float32")[i % 3]) for i in range(12)]
    passes = [expand(f"p{i}", "pass", add_inputs=i % 5 != 0, dtype=("float16", "bfloat16", "float32")[i % 3]) for i in range(30)]
    [cluster] = cluster_failures([*failures, *passes])[0]
    assert cluster["only_with"] == ["add_inputs=False"]  # every dtype fails: the dtype stays out
    assert cluster["title"] == "columns outside the written region are overwritten (only with add_inputs=False)"
    # the same failures with no passing case besides them: nothing shows what they depend on
    assert cluster_failures(failures)[0][0]["only_with"] == []
    # too few failures to tell a dependence from chance
    assert cluster_failures([*failures[:2], *passes])[0][0]["only_with"] == []


def test_two_causes_with_one_description_are_split_by_their_knob_values():
    offset = [expand(f"o{i}", offset_start=4) for i in range(10)]
    rewrite = [expand(f"r{i}", add_inputs=False) for i in range(10)]
    passes = [expand(f"p{i}", "pass", add_inputs=i % 5 != 0, offset_start=4 * (i % 4 == 0)) for i in range(40)]
    clusters, membership = cluster_failures([*rewrite, *passes, *offset])
    assert sorted(c["only_with"] for c in clusters) == [["add_inputs=False"], ["offset_start > 0"]]
    assert {frozenset(ids) for ids in members(membership).values()} == {
        frozenset(r["id"] for r in offset), frozenset(r["id"] for r in rewrite),
    }  # fmt: skip
    assert cluster_failures([*reversed(passes), *offset, *reversed(rewrite)])[0] == clusters  # order independent
    # and a failure that shows another kind joins the cause whose knob value it has
    nothing = expand("o-nothing", kinds=("wrote nothing",), offset_start=4)
    clusters, membership = cluster_failures([*rewrite, *passes, *offset, nothing])
    assert len(clusters) == 2 and membership["o-nothing"] == membership["o0"]
    assert set(clusters[membership["o0"] - 1]["kinds"]) == {OUTSIDE, "wrote nothing"}


def test_a_cause_whose_kinds_depend_on_more_knob_values_is_one_cluster():
    """A rank tail dropped: nothing written where add_inputs=True, too little with either; only with a rank no
    multiple of 16 (``RankTailIgnored``)."""
    nothing = [expand(f"n{i}", kinds=("wrote nothing",), max_rank=8) for i in range(20)]
    too_little = [expand(f"t{i}", kinds=(NUMERICS,), max_rank=8, add_inputs=i % 2 == 0) for i in range(16)]
    passes = [expand(f"p{i}", "pass", max_rank=(8, 16, 16, 32)[i % 4], add_inputs=i % 2 == 0) for i in range(40)]
    [cluster] = cluster_failures([*nothing, *too_little, *passes])[0]
    assert cluster["count"] == 36 and cluster["only_with"] == ["a rank no multiple of 16"]
    assert cluster["title"].startswith("adapter rows receive nothing")  # the larger group's description


def test_the_report_and_results_json_say_what_each_problem_depends_on(tmp_path):
    offset = [expand(f"o{i}", offset_start=4) for i in range(12)]
    rewrite = [expand(f"r{i}", add_inputs=False) for i in range(10)]
    passes = [expand(f"p{i}", "pass", add_inputs=i % 5 != 0, offset_start=4 * (i % 4 == 0)) for i in range(40)]
    numbered = add_clusters(document([*offset, *rewrite, *passes]))
    assert [(c["only_with"], c["conditions"]) for c in numbered["clusters"]] == [
        (["offset_start > 0"], {"offset": [True]}), (["add_inputs=False"], {"add_inputs": [False]}),
    ]  # fmt: skip
    page = parse(write_html_report(numbered, tmp_path / "report.html"))
    assert page.text[".only-with"] == ["offset_start > 0", "add_inputs=False"]
    headings = [text.split("—")[0].strip() for text in page.text[".cluster"]]
    assert headings == [f"{c['id']}. {c['title']}" for c in numbered["clusters"]]
    assert headings[1] == "2. columns outside the written region are overwritten (only with add_inputs=False)"


def test_a_dtype_only_bug_is_a_cause_of_its_own():
    low_precision = [expand(f"d{i}", dtype=("float16", "bfloat16")[i % 2], kinds=(NUMERICS,)) for i in range(30)]
    passes = [expand(f"p{i}", "pass", dtype=("float16", "bfloat16", "float32")[i % 3]) for i in range(60)]
    [cluster] = cluster_failures([*low_precision, *passes])[0]
    assert cluster["only_with"] == ["dtype bfloat16 or float16"]
