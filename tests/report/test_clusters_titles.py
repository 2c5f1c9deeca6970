"""A cluster's title is true of every member it gathers, and says what the target wrote where it must not.

* a group joined to a larger one by the knob values they share (``conformance.report.clusters``: one cause
  that shows in several ways, or a few failures of another cause that happen to have those values) keeps
  the larger group's signature; its title names every description its op members need (``described``),
  so "columns outside the written region are overwritten" does not stand over a case whose adapter rows
  exceed the error budget;
* elements written outside the region read "are zeroed" where every member wrote zeros there (the
  result's ``outside_zeroed``, from the values the referee compared), "are overwritten" otherwise; a
  failure's message says "zeroed N element(s)" then, not "wrote".
"""

from __future__ import annotations

import pytest
from fault_targets import NegativeIndexIsLastSlot, NoAdapterRowsOverwritten
from test_clusters import NUMERICS, OUTSIDE
from test_clusters_causes import clusters_whose_titles_fit, expand, judged

from conformance.generator.profiles import profile_cases
from conformance.report.clusters import cluster_failures


def test_a_failure_of_another_kind_joined_by_knob_values_is_named_in_the_title():
    offset = [expand(f"o{i}", offset_start=4) for i in range(10)]
    over_budget = expand("n0", kinds=(NUMERICS,), offset_start=4)  # another cause's failure, with the same knob value
    passes = [expand(f"p{i}", "pass", offset_start=4 * (i % 4 == 0)) for i in range(40)]
    clusters, membership = cluster_failures([*offset, over_budget, *passes])
    [cluster] = clusters
    assert membership["n0"] == membership["o0"]  # joined: its knob values are the larger group's
    # before, the title said "columns outside the written region receive a delta (only with offset_start > 0)"
    assert cluster["title"] == ("columns outside the written region are overwritten, "
                                "or adapter rows exceed the error budget (only with offset_start > 0)")
    assert cluster["described"] == [{"kind": OUTSIDE, "where": "columns outside the written region"},
                                    {"kind": NUMERICS, "where": "adapter rows"}]


def test_every_member_fits_a_description_its_title_names():
    """Mixed causes and ways of showing: each op member fits one of the descriptions its cluster's title names."""
    records = [
        *(expand(f"o{i}", offset_start=4) for i in range(10)),
        *({**expand(f"z{i}", kinds=(OUTSIDE,), slots=(-1,), add_inputs=False), "outside_zeroed": True} for i in range(6)),
        expand("z-numerics", kinds=(NUMERICS,), add_inputs=False),
        expand("o-nothing", kinds=("wrote nothing",), offset_start=4),
        *(expand(f"p{i}", "pass", add_inputs=i % 5 != 0, offset_start=4 * (i % 4 == 0)) for i in range(40)),
    ]
    clusters, _ = clusters_whose_titles_fit(records)
    assert [c["title"] for c in clusters] == [
        "columns outside the written region are overwritten, or adapter rows receive nothing "
        "(the output is unchanged where it must be written) (only with offset_start > 0)",
        "rows without adapter are zeroed, or adapter rows exceed the error budget (only with add_inputs=False)",
    ]


@pytest.fixture(scope="module")
def no_adapter_cases():
    """Expand cases with rows without adapter and add_inputs=False (where the overwriting fault shows)."""
    cases = profile_cases("smoke", ops=("lora_expand", "sgmv_expand", "bgmv_expand"))
    return [(case_id, case) for case_id, case in cases if not case.add_inputs and -1 in case.seq_slots][:3]


def test_rows_without_adapter_zeroed_are_said_zeroed_and_others_overwritten(no_adapter_cases):
    assert no_adapter_cases
    zeroed = judged(NoAdapterRowsOverwritten(), no_adapter_cases)
    assert all(r["outside_zeroed"] is True and "zeroed " in r["message"] for r in zeroed)  # before: "wrote N element(s)"
    [cluster] = cluster_failures(zeroed)[0]
    assert cluster["title"] == "rows without adapter are zeroed"  # before: "rows without adapter receive a delta"

    delta = judged(NegativeIndexIsLastSlot(), no_adapter_cases)  # the last slot's delta: not zero
    assert all(r["outside_zeroed"] is False and "wrote " in r["message"] for r in delta)
    [cluster] = cluster_failures(delta)[0]
    assert cluster["title"] == "rows without adapter are overwritten"
    # one zeroed and one not: "overwritten" is true of both
    [cluster] = cluster_failures([zeroed[0], {**delta[1], "id": "other"}])[0]
    assert cluster["title"] == "rows without adapter are overwritten"
