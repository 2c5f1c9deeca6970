"""The report layer: the self-contained HTML report, `--shard I/N`, and merging shards into one verdict.

The HTML tests render synthetic documents (no pytest run); the shard and merge tests run the suite in
subprocesses on the `reference` target, as vendor CI does, filtered to one op so they stay quick.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conformance.gate import gate_verdict, summarize
from conformance.journal import case_list_summary
from conformance.report import MergeError, merge_documents, write_html_report

ROOT = Path(__file__).resolve().parents[2]
FILTER = ("-k", "bgmv_shrink or bgmv_expand")  # about 100 smoke cases, a few seconds


def conformance(*args: str, report_dir: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def report_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance.report", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def result(case_id: str, op: str, dtype: str, outcome: str, level: str = "kernel", ratio: float | None = 0.1, **extra) -> dict:
    measurement = None if ratio is None else {"max_abs_error": ratio * 1e-3, "max_ulp": 2.0, "budget": 1e-3, "budget_ratio": ratio}
    return {
        "id": case_id, "op": op, "level": level, "dtype": dtype, "family": "mixed", "features": [],
        "outcome": outcome, "message": extra.pop("message", ""), "measurement": measurement,
        "expectation": None, "replay": None, "repro": None, "case": {}, **extra,
    }  # fmt: skip


def document(results: list[dict], shard_cases: list[str] | None = None, **about) -> dict:
    """A results document holding ``results``, its shard holding ``shard_cases`` (default: those results)
    of a profile whose case list is SYNTHETIC's."""
    shard_cases = [r["id"] for r in results] if shard_cases is None else shard_cases
    base = {"suite_version": "0.1.0", "target": "acme", "profile": "smoke", "seed": 0, "replay": None, "expectations": None, "python": "3.12.0"}
    lists = {"case_list": case_list_summary([r["id"] for r in SYNTHETIC]), "shard_cases": shard_cases, "expected": shard_cases}
    return {**base, **lists, **about, "gate": gate_verdict(results), "summary": summarize(results), "results": results}


SYNTHETIC = [
    result("bgmv_shrink-bf16-a", "bgmv_shrink", "bfloat16", "pass"),
    result("bgmv_shrink-f32-b", "bgmv_shrink", "float32", "pass", ratio=0.001),
    result(
        "bgmv_shrink-bf16-c", "bgmv_shrink", "bfloat16", "fail", ratio=37.5, message="max error 3.7e-2 > budget 1e-3",
        replay="reports/acme/replays/bgmv_shrink-bf16-c.json",
        repro="pytest conformance --target=acme --replay reports/acme/replays/bgmv_shrink-bf16-c.json",
    ),
    result("add_lora_linear-f16-d", "add_lora_linear", "float16", "broken", level="wrapper", ratio=None, message="RuntimeError: boom",
           repro="pytest conformance --target=acme --replay r/add_lora_linear-f16-d.json", replay="r/add_lora_linear-f16-d.json"),
    result("add_lora_linear-f16-e", "add_lora_linear", "float16", "not supported", level="wrapper", ratio=None),
    result(
        "sgmv_expand-bf16-f", "sgmv_expand", "bfloat16", "known failure", ratio=2.0,
        expectation={"id": "acme-expand-bf16", "reason": "accumulates in bf16", "upstream": ["https://github.com/acme/k/issues/7"], "expires": "2027-01-01"},
    ),
]  # fmt: skip


class Elements(HTMLParser):
    """Which ids and classes the page has, and the text under each id / class (for asserting on)."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, list[str]] = {}
        self.open: list[list[str]] = []
        self.urls: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        keys = [f"#{attrs['id']}"] if attrs.get("id") else []
        keys += [f".{cls}" for cls in (attrs.get("class") or "").split()]
        for name in ("src", "href"):
            if attrs.get(name) and tag != "a":
                self.urls.append(attrs[name])
        if tag not in ("meta", "br", "circle", "line", "rect"):
            self.open.append(keys)
            for key in keys:
                self.text.setdefault(key, []).append("")

    def handle_endtag(self, tag):
        if tag not in ("meta", "br", "circle", "line", "rect") and self.open:
            self.open.pop()

    def handle_data(self, data):
        for keys in self.open:
            for key in keys:
                self.text[key][-1] += data


def parse(path: Path) -> Elements:
    elements = Elements()
    elements.feed(path.read_text())
    return elements


def test_html_report_shows_verdict_matrix_failures_and_known_failures(tmp_path):
    path = write_html_report(document(SYNTHETIC), tmp_path / "report.html")
    page = parse(path)
    [verdict] = page.text["#verdict"]
    assert "FAIL" in verdict and "every result is pass" in verdict
    assert "1 case(s) ended fail" in verdict and "1 case(s) ended broken" in verdict
    [matrix] = page.text["#matrix"]
    for expected in ("kernel", "wrapper", "bgmv_shrink", "add_lora_linear", "bfloat16", "float32", "1 fail", "1 broken", "1 not supported"):
        assert expected in matrix
    assert matrix.index("kernel") < matrix.index("bgmv_shrink") < matrix.index("wrapper") < matrix.index("add_lora_linear")
    repros = page.text[".repro"]
    assert "pytest conformance --target=acme --replay reports/acme/replays/bgmv_shrink-bf16-c.json" in repros
    [failures] = page.text["#failures"]
    assert "bgmv_shrink-bf16-c" in failures and "37.5" in failures and "RuntimeError: boom" in failures
    assert "bgmv_shrink-bf16-a" not in failures and "sgmv_expand-bf16-f" not in failures
    [known] = page.text["#known-failures"]
    assert "acme-expand-bf16" in known and "https://github.com/acme/k/issues/7" in known and "2027-01-01" in known
    assert "#budget-ratios" in page.text and "svg" in page.tags and "script" not in page.tags
    assert "3.12.0" in page.text["#environment"][0]
    assert page.urls == []  # nothing to load: the file reads the same offline


def test_html_report_of_a_passing_run_says_pass_and_lists_the_environment(tmp_path):
    results = [r for r in SYNTHETIC if r["outcome"] in ("pass", "not supported")]
    path = write_html_report(document(results, environment={"torch": "2.9.0", "device": "Gaudi 3"}), tmp_path / "r.html")
    page = parse(path)
    assert "PASS" in page.text["#verdict"][0]
    assert "Gaudi 3" in page.text["#environment"][0] and "torch" in page.text["#environment"][0]
    assert page.text.get(".repro") is None


@pytest.mark.integration  # a whole run in a subprocess
def test_shards_merge_into_the_unsharded_run(tmp_path):
    whole = tmp_path / "whole"
    assert conformance("--target=reference", "--profile=smoke", report_dir=whole).returncode == 0
    shard_files = []
    for shard in ("0/2", "1/2"):
        out = tmp_path / f"shard{shard[0]}"
        completed = conformance("--target=reference", "--profile=smoke", "--shard", shard, report_dir=out)
        assert completed.returncode == 0, completed.stdout[-2000:]
        assert json.loads((out / "results.json").read_text())["shard"] == shard
        assert (out / "report.html").is_file() and f"report: {out / 'report.html'}" in completed.stdout
        shard_files.append(out / "results.json")
    shard_ids = [{r["id"] for r in json.loads(f.read_text())["results"]} for f in shard_files]
    assert shard_ids[0] and shard_ids[1] and not shard_ids[0] & shard_ids[1]

    merged_dir = tmp_path / "merged"
    completed = report_cli("merge", *map(str, shard_files), "--out", str(merged_dir))
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("verdict: PASS")
    merged, unsharded = (json.loads((d / "results.json").read_text()) for d in (merged_dir, whole))
    assert len(unsharded["results"]) >= 50
    assert [r["id"] for r in merged["results"]] == [r["id"] for r in unsharded["results"]]
    assert merged["gate"] == unsharded["gate"] and merged["summary"] == unsharded["summary"]
    assert "PASS" in parse(merged_dir / "report.html").text["#verdict"][0]
    # one machine, two shards: the same fingerprint once, and both shards' workers
    fingerprints = [json.loads(f.read_text())["environment"] for f in shard_files]
    assert fingerprints[0] == fingerprints[1] == merged["environment"] and "environments" not in merged
    assert merged["environment"]["git_commit"] in parse(merged_dir / "report.html").text["#environment"][0]
    assert [w["source"] for w in merged["workers"]] == [str(f) for f in shard_files]

    completed = report_cli("merge", str(shard_files[0]), "--out", str(tmp_path / "half"))
    assert completed.returncode == 1 and "shard(s) 1/2 missing" in completed.stdout

    # shards run with a selection do not add up to the profile: the merge names what they left out
    selected = tmp_path / "selected"
    assert conformance("--target=reference", "--profile=smoke", *FILTER, "--shard", "1/2", report_dir=selected).returncode == 0
    selected_document = json.loads((selected / "results.json").read_text())
    completed = report_cli("merge", str(shard_files[0]), str(selected / "results.json"), "--out", str(tmp_path / "partial"))
    merged = json.loads((tmp_path / "partial" / "results.json").read_text())
    left_out = set(selected_document["shard_cases"]) - {r["id"] for r in selected_document["results"]}
    assert completed.returncode == 1 and left_out and set(merged["missing"]) == left_out
    assert "expected case(s) have no result" in completed.stdout and merged["missing"][0] in completed.stdout


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_merge_refuses_different_targets_and_conflicting_outcomes(tmp_path):
    ours = document(SYNTHETIC[:2])
    theirs = document(SYNTHETIC[:2], target="other")
    paths = []
    for name, doc in (("ours", ours), ("theirs", theirs)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    completed = report_cli("merge", *map(str, paths), "--out", str(tmp_path / "out"))
    assert completed.returncode == 2
    assert "'target'" in completed.stderr and "'acme'" in completed.stderr and "'other'" in completed.stderr
    assert not (tmp_path / "out" / "results.json").exists()

    conflicting = document([{**SYNTHETIC[0], "outcome": "fail"}])
    try:
        merge_documents([ours, conflicting], ["a.json", "b.json"], check_cases=False)
    except MergeError as exc:
        assert SYNTHETIC[0]["id"] in str(exc) and "a.json" in str(exc) and "b.json" in str(exc)
    else:
        raise AssertionError("conflicting outcomes merged")
    same = merge_documents([ours, document(SYNTHETIC[:1])], check_cases=False)  # the same case twice, same outcome: one case
    assert [r["id"] for r in same["results"]] == sorted(r["id"] for r in SYNTHETIC[:2])


def test_merge_of_machines_that_differ_keeps_each_fingerprint(tmp_path):
    gaudi2 = {"git_commit": "abc", "torch": "2.6.0", "device": "hpu: GAUDI2", "env.PT_HPU_LAZY_MODE": "1"}
    gaudi3 = {**gaudi2, "device": "hpu: GAUDI3"}
    first = document(SYNTHETIC[:1], shard="0/2", environment=gaudi2, workers=[{"worker": "gw0", "HABANA_VISIBLE_MODULES": "0"}])
    second = document(SYNTHETIC[1:2], shard="1/2", environment=gaudi3)
    merged = merge_documents([first, second], ["m0/results.json", "m1/results.json"], check_cases=False)
    assert merged["environment"]["device"] == "hpu: GAUDI2; hpu: GAUDI3" and merged["environment"]["torch"] == "2.6.0"
    assert [(f["source"], f["shard"], f["environment"]) for f in merged["environments"]] == [
        ("m0/results.json", "0/2", gaudi2), ("m1/results.json", "1/2", gaudi3)
    ]  # fmt: skip
    assert merged["workers"] == [{"source": "m0/results.json", "worker": "gw0", "HABANA_VISIBLE_MODULES": "0"}]
    page = parse(write_html_report(merged, tmp_path / "merged.html"))
    [environment] = page.text["#environment"]
    assert "m0/results.json (shard 0/2)" in environment and "GAUDI2" in environment and "GAUDI3" in environment
    assert [text for text in page.text[".differs"]] == ["devicehpu: GAUDI2hpu: GAUDI3"]  # only the row that differs
    assert "HABANA_VISIBLE_MODULES" in page.text["#workers"][0]


def test_merge_keeps_a_failure_the_results_do_not_show():
    interrupted = document(SYNTHETIC[:1])
    interrupted["gate"] = gate_verdict(SYNTHETIC[:1], 2)
    assert not interrupted["gate"]["passed"]
    merged = merge_documents([interrupted, document(SYNTHETIC[1:2])], ["a.json", "b.json"], check_cases=False)
    assert not merged["gate"]["passed"]
    assert any(reason.startswith("a.json: pytest exited with status 2") for reason in merged["gate"]["reasons"])


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_html_subcommand_renders_a_results_file(tmp_path):
    source = tmp_path / "results.json"
    source.write_text(json.dumps(document(SYNTHETIC)))
    completed = report_cli("html", str(source), "--out", str(tmp_path / "out.html"))
    assert completed.returncode == 0, completed.stderr
    assert re.search(r'id="verdict"', (tmp_path / "out.html").read_text())


def test_the_verdict_line_names_the_target_by_its_short_name():
    from conformance.report.__main__ import verdict_line

    line = verdict_line(document(SYNTHETIC, target="my_backend.lora:HpuTarget", target_name="hpu-lora"))
    assert line.startswith("verdict: FAIL — target hpu-lora, profile smoke") and "my_backend" not in line
    assert "target acme," in verdict_line(document(SYNTHETIC))  # an older document without target_name: as it was asked for


@pytest.mark.integration  # a whole run in a subprocess
def test_a_malformed_shard_is_a_usage_error_naming_the_option(tmp_path):
    for value in ("3/2", "a/b"):
        completed = conformance("--target=reference", "--profile=smoke", f"--shard={value}", report_dir=tmp_path)
        assert completed.returncode == 4, (value, completed.stdout[-500:])  # pytest's usage-error status
        errors = [line for line in completed.stderr.splitlines() if line.startswith("ERROR")]
        assert errors and "--shard" in errors[0] and value in errors[0]


def test_the_end_to_end_section_says_each_model_cases_engine_checks(tmp_path):
    checked = {"base_request_invariance": "checked", "graphs_vs_eager": "not supported here: vLLM on the CPU captures no graphs"}
    model = [
        result("e2e-greedy-pass", "greedy_generation", "float32", "pass", level="model", engine_checks=checked),
        result("e2e-greedy-fail", "greedy_generation", "bfloat16", "fail", level="model", kinds=["changed base requests"],
               engine_checks={"base_request_invariance": "checked", "graphs_vs_eager": "checked"}),
        result("e2e-moe-unsupported", "moe_greedy_generation", "float32", "not supported", level="model", engine_checks=None),
    ]
    path = write_html_report(document([*SYNTHETIC, *model]), tmp_path / "report.html")
    html = path.read_text()
    [section] = parse(path).text["#end-to-end"]
    assert "End to end (3)" in section and "vLLM on the CPU captures no graphs" in section
    assert section.count("not run") == 2  # the unsupported case ran neither check: said, not left blank
    # the failure links to its row in the failures section; a passing case has no row there to link to
    assert '<a href="#case-e2e-greedy-fail">' in html and 'id="case-e2e-greedy-fail"' in html
    assert '<a href="#case-e2e-greedy-pass">' not in html
    # op and wrapper cases are not listed there
    assert "bgmv_shrink-bf16-a" not in section


def test_a_run_without_end_to_end_cases_has_no_end_to_end_section(tmp_path):
    html = write_html_report(document(SYNTHETIC), tmp_path / "report.html").read_text()
    assert 'id="end-to-end"' not in html
