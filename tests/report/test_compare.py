"""``python -m conformance.report compare``: runs of two targets side by side, and what it refuses.

A module-scoped pair of real runs of the smoke profile, ``hpu-emulated`` and ``cpu`` (vLLM's CPU ops
and engine, with its shipped expectations), over a few ops and the end-to-end generation cases, run in
parallel (about 45 s, the cpu run's vLLM engines), is compared with the command line; compare.json is
checked against the two results.json and compare.html in headless chromium (CI installs it; a missing
chromium fails, it never skips). The rules themselves (closer to the reference, outcomes, labels, tokens)
are checked on synthetic documents.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_artifacts import CHROMIUM_FLAGS, chromium, conformance, parse_html, png_summary
from test_report import SYNTHETIC, document, parse, result

from conformance.cli import main as cli_main
from conformance.report.compare import CompareError, compare_documents, first_difference
from conformance.report.compare_html import write_compare_html
from conformance.verdict.judge import number_from_json

ROOT = Path(__file__).resolve().parents[2]
# kernel and wrapper ops the cpu target runs (with known failures), one it does not support (MoE), and the
# end-to-end greedy and teacher-forced cases (dense: vLLM's engine; MoE: not supported on cpu)
SUBSET = ("--profile=smoke", "-k", "bgmv_shrink or add_lora_linear or fused_moe_lora or greedy_generation or teacher_forced_logits")
TARGETS = ("hpu-emulated", "cpu")


def report_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance.report", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Report dirs of the two targets' runs, and of an hpu-emulated run of another seed (``seed-1``)."""
    base = tmp_path_factory.mktemp("compare-runs")
    jobs = {target: (f"--target={target}", *SUBSET) for target in TARGETS}
    jobs["seed-1"] = ("--target=hpu-emulated", *SUBSET, "--seed=1")
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = dict(zip(jobs, pool.map(lambda name: conformance(*jobs[name], report_dir=base / name), jobs)))
    for name, completed in done.items():
        assert completed.returncode == 0, f"{name}: {completed.stdout[-3000:]}{completed.stderr[-3000:]}"
    return {name: base / name for name in jobs}


@pytest.fixture(scope="module")
def compared(runs, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict, dict[str, dict]]:
    out = tmp_path_factory.mktemp("compare-out")
    completed = report_cli("compare", str(runs["hpu-emulated"] / "results.json"), str(runs["cpu"]), "--out", str(out))
    assert completed.returncode == 0, completed.stderr
    documents = {target: json.loads((runs[target] / "results.json").read_text()) for target in TARGETS}
    return out, completed, json.loads((out / "compare.json").read_text()), documents


def outcomes(documents: dict[str, dict]) -> dict[str, dict[str, str]]:
    return {target: {r["id"]: r["outcome"] for r in document["results"]} for target, document in documents.items()}


def test_end_to_end_results_record_the_generated_tokens(compared):
    _, _, _, documents = compared
    for target, run in documents.items():
        e2e = [r for r in run["results"] if r["level"] == "model"]
        assert {r["op"] for r in e2e} >= {"greedy_generation", "teacher_forced_logits"}
        for record in e2e:
            if record["outcome"] == "not supported":
                assert record["tokens"] is None, (target, record["id"])
                continue
            tokens, requests = record["tokens"], record["case"]["requests"]
            assert tokens["source"] == ("top-1" if record["op"].endswith("teacher_forced_logits") else "greedy")
            for run in ("target", "reference"):
                assert [len(t) for t in tokens[run]] == [record["case"]["max_new_tokens"]] * len(requests), (target, record["id"])
            if record["outcome"] == "pass" and record["dtype"] == "float32":
                assert tokens["target"] == tokens["reference"]  # no near-tie in float32 on the fixtures


def test_compare_json_counts_each_runs_outcomes_and_names_the_cases_that_differ(compared):
    _, completed, comparison, documents = compared
    by_target = outcomes(documents)
    assert [run["label"] for run in comparison["runs"]] == list(TARGETS)
    assert (comparison["profile"], comparison["seed"], comparison["cases"]) == ("smoke", 0, len(by_target["cpu"]))
    assert {run["label"]: run["counts"] for run in comparison["runs"]} == {t: dict(Counter(o.values())) for t, o in by_target.items()}

    # per level × op × dtype: each run's counts and ratio quantiles, as its own results say
    cells = {(c["level"], c["op"], c["dtype"]): c for c in comparison["cells"]}
    assert set(cells) == {(r["level"], r["op"], r["dtype"]) for r in documents["cpu"]["results"]}
    for (level, op, dtype), cell in cells.items():
        for target, run in documents.items():
            # by level too: a serving case names the op of the layer it serves (add_lora_linear at both levels)
            mine = [r for r in run["results"] if (r["level"], r["op"], r["dtype"]) == (level, op, dtype)]
            assert cell["runs"][target]["counts"] == dict(Counter(r["outcome"] for r in mine))
            # as results.json writes them: an infinite ratio (an end-to-end token given no probability) as "inf"
            ratios = sorted(number_from_json(r["measurement"]["budget_ratio"]) for r in mine
                            if number_from_json((r.get("measurement") or {}).get("budget_ratio")) is not None)
            spread = cell["runs"][target]["budget_ratio"]
            if ratios:
                assert (spread["n"], spread["min"], spread["max"]) == (len(ratios), ratios[0], ratios[-1])
            else:
                assert spread is None
    assert cells["kernel", "bgmv_shrink", "float32"]["closer"]["cases"] > 0  # both pass some: one is closer, or as close

    # the cases whose outcomes differ where both run them: cpu's known failures (slot −1), and nothing else
    differing = {case["id"] for case in comparison["differing"]}
    supported = [i for i in by_target["cpu"] if "not supported" not in (by_target["cpu"][i], by_target["hpu-emulated"][i])]
    assert differing == {i for i in supported if by_target["cpu"][i] != by_target["hpu-emulated"][i]}
    assert differing and {by_target["cpu"][i] for i in differing} == {"known failure"}
    cpu_records = {r["id"]: r for r in documents["cpu"]["results"]}
    for case in comparison["differing"]:
        cpu = case["runs"]["cpu"]
        assert cpu["message"] == cpu_records[case["id"]]["message"] and cpu["repro"] == cpu_records[case["id"]]["repro"]
        assert cpu["repro"].startswith("pytest ") and case["runs"]["hpu-emulated"]["outcome"] == "pass"
    assert f"{len(differing)} differ" in completed.stdout

    # the cases one does not support: cpu has no MoE LoRA (and no LoRA bias)
    unsupported = {case["id"]: case for case in comparison["unsupported"]}
    assert set(unsupported) == {i for i, o in by_target["cpu"].items() if o == "not supported"}
    assert {case["op"] for case in unsupported.values()} >= {"fused_moe_lora", "moe_greedy_generation"}
    assert all(case["not_supported_by"] == ["cpu"] for case in unsupported.values())


def test_compare_json_says_whether_the_end_to_end_tokens_agree(compared):
    _, _, comparison, documents = compared
    records = {target: {r["id"]: r for r in d["results"] if r["level"] == "model"} for target, d in documents.items()}
    entries = {entry["id"]: entry for entry in comparison["e2e"]}
    assert set(entries) == set(records["cpu"])
    for case_id, entry in entries.items():
        tokens = {target: records[target][case_id]["tokens"] for target in TARGETS}
        if tokens["cpu"] is None:  # the MoE model: cpu does not support it
            assert entry["agree"] is None and "cpu (not supported)" in entry["why"]
            continue
        generated = {target: t["target"] for target, t in tokens.items()}
        assert entry["agree"] == (generated["hpu-emulated"] == generated["cpu"])
        for target in TARGETS:
            assert entry["runs"][target]["matches_reference"] == (generated[target] == tokens[target]["reference"])
        if not entry["agree"]:
            where = entry["first_difference"]
            request, position = where["request"], where["position"]
            assert generated["hpu-emulated"][:request] == generated["cpu"][:request]
            assert where["tokens"] == {target: generated[target][request][position] for target in TARGETS}
            assert generated["hpu-emulated"][request][:position] == generated["cpu"][request][:position]
            assert where["adapter"] == records["cpu"][case_id]["case"]["requests"][request]["adapter"]
    # vLLM's slot −1 bug: cpu's base requests take another adapter and generate other tokens (a known failure)
    greedy = entries["model:greedy_generation:batch=mixed;dtype=fp32"]
    if greedy["runs"]["cpu"]["outcome"] == "known failure":
        assert greedy["agree"] is False and greedy["first_difference"]["adapter"] is None


def test_compare_html_renders_in_headless_chromium_naming_the_cases_that_differ(compared, tmp_path):
    out, _, comparison, _ = compared
    url = (out / "compare.html").resolve().as_uri()
    base = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "compare.png"
    completed = subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0 and shot.is_file(), completed.stderr[-2000:]
    assert png_summary(shot)[2] >= 20, "the screenshot is blank"
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    page = parse_html(dom, tmp_path)
    assert page.urls == [] and "script" not in page.tags  # self-contained: nothing to load, nothing to run
    [differing] = page.text["#differing"]
    for case in comparison["differing"]:
        assert case["id"] in differing
    assert "known failure" in differing and any(case["runs"]["cpu"]["repro"] in page.text[".repro"] for case in comparison["differing"])
    [cells] = page.text["#cells"]
    assert cells.index("kernel") < cells.index("bgmv_shrink") < cells.index("wrapper") < cells.index("add_lora_linear")
    assert cells.index("add_lora_linear") < cells.index("model") < cells.index("greedy_generation")
    assert "hpu-emulated" in cells and "cpu" in cells and "known failure" in cells and "not supported" in cells
    assert len(page.text[".closer"]) == sum(1 for c in comparison["cells"] if c["closer"] and c["closer"]["cases"])
    assert "#ratio-plot" in page.text and "svg" in page.tags
    assert len(page.text[".series"]) == sum(
        1 for cell in comparison["cells"] for run in cell["runs"].values() if run["ratios"]
    )  # a box per run and op × dtype, on one axis
    [unsupported] = page.text["#unsupported"]
    assert "fused_moe_lora" in unsupported and "cpu" in unsupported
    [tokens] = page.text["#e2e-tokens"]
    for entry in comparison["e2e"]:
        assert entry["id"] in tokens
    assert page.text["#summary"][0].count("case(s)") >= 2


def test_compare_refuses_a_run_of_another_seed_naming_the_difference(runs, tmp_path):
    completed = report_cli("compare", str(runs["hpu-emulated"]), str(runs["seed-1"]), "--out", str(tmp_path / "out"))
    assert completed.returncode == 2 and not (tmp_path / "out" / "compare.html").exists()
    message = completed.stderr
    assert message.startswith("error: cannot compare: seed 0 in ") and "but 1 in" in message
    theirs = {r["id"] for r in json.loads((runs["seed-1"] / "results.json").read_text())["results"]}
    ours = {r["id"] for r in json.loads((runs["hpu-emulated"] / "results.json").read_text())["results"]}
    assert f"{len(ours - theirs)} case(s) only in {runs['hpu-emulated']}" in message
    assert sorted(ours - theirs)[0] in message and sorted(theirs - ours)[0] in message


# -- the rules, on synthetic documents --------------------------------------------------------------


def two_runs(ours: list[dict], theirs: list[dict]) -> list[dict]:
    return [document(ours, target="acme"), document(theirs, target="other")]


def test_refusals_name_cases_only_one_run_holds_and_cases_drawn_differently():
    with pytest.raises(CompareError, match="at least two runs"):
        compare_documents([document(SYNTHETIC)])
    with pytest.raises(CompareError) as refused:
        compare_documents(two_runs(SYNTHETIC, SYNTHETIC[:-1]), ["a.json", "b.json"])
    assert f"1 case(s) only in a.json ({SYNTHETIC[-1]['id']}), 0 only in b.json" in str(refused.value)
    drawn = [{**r, "case": {"seed": 1}} for r in SYNTHETIC]
    redrawn = [{**drawn[0], "case": {"seed": 2}}, *drawn[1:]]  # the same id, another case
    with pytest.raises(CompareError) as refused:
        compare_documents(two_runs(redrawn, drawn))
    assert f"1 case(s) were drawn differently under the same id in input 1 and input 2 ({SYNTHETIC[0]['id']})" in str(refused.value)
    with pytest.raises(CompareError, match="profile 'smoke' in input 1 but 'standard' in input 2"):
        compare_documents([document(SYNTHETIC), document(SYNTHETIC, profile="standard")])


def test_every_outcome_and_a_missing_result_are_compared():
    ids = [r["id"] for r in SYNTHETIC]
    theirs = [{**r, "outcome": "pass"} for r in SYNTHETIC[:-1]]  # the last case has no result: missing
    theirs[0] = {**theirs[0], "outcome": "unexpected pass"}
    comparison = compare_documents([document(SYNTHETIC, target="acme"), document(theirs, shard_cases=ids, target="other")])
    by_id = {case["id"]: case for case in comparison["differing"]}
    assert by_id[SYNTHETIC[-1]["id"]]["runs"]["other"]["outcome"] == "missing"
    assert by_id[SYNTHETIC[0]["id"]]["runs"]["other"]["outcome"] == "unexpected pass"
    assert by_id["bgmv_shrink-bf16-c"]["runs"]["acme"]["repro"].startswith("pytest conformance --target=acme")
    # acme does not support add_lora_linear-f16-e; other passes it: listed apart, not as differing
    [unsupported] = comparison["unsupported"]
    assert unsupported["id"] == "add_lora_linear-f16-e" and unsupported["not_supported_by"] == ["acme"]
    assert "add_lora_linear-f16-e" not in by_id


def test_the_closer_run_is_the_one_with_smaller_ratios_where_both_pass():
    def cases(ratios: list[float], outcome: str = "pass") -> list[dict]:
        return [result(f"bgmv_shrink-f32-{i}", "bgmv_shrink", "float32", outcome, ratio=r) for i, r in enumerate(ratios)]

    ours, theirs = cases([0.1, 0.2, 0.3, 0.4]), cases([0.2, 0.1, 0.5, 0.4])
    theirs.append(result("bgmv_shrink-f32-4", "bgmv_shrink", "float32", "fail", ratio=3.0))
    ours.append(result("bgmv_shrink-f32-4", "bgmv_shrink", "float32", "pass", ratio=0.01))
    documents = [document(ours, target="acme"), document(theirs, target="other")]
    [cell] = compare_documents(documents)["cells"]
    closer = cell["closer"]
    assert closer["cases"] == 4  # the case other fails is not compared
    assert closer["closest_on"] == {"acme": 2, "other": 1} and closer["ties"] == 1 and closer["closer"] == "acme"
    assert closer["median"]["budget_ratio"] == pytest.approx({"acme": 0.25, "other": 0.3})
    assert cell["runs"]["other"]["budget_ratio"]["max"] == 3.0 and cell["runs"]["other"]["counts"] == {"pass": 4, "fail": 1}
    identical = compare_documents([document(ours, target="acme"), document(ours, target="other")])["cells"][0]["closer"]
    assert identical["closer"] is None and identical["ties"] == 5


def test_runs_of_one_target_are_told_apart_by_their_source(tmp_path):
    comparison = compare_documents([document(SYNTHETIC), document(SYNTHETIC)], ["m0/results.json", "m1/results.json"])
    assert [run["label"] for run in comparison["runs"]] == ["acme (m0/results.json)", "acme (m1/results.json)"]
    assert comparison["differing"] == [] and comparison["summary"]["differing"] == 0
    page = parse(write_compare_html(comparison, tmp_path / "compare.html"))
    assert "acme (m1/results.json)" in page.text["#runs"][0] and page.text["#differing"] == ["none"]


def test_first_difference_finds_the_request_and_position():
    assert first_difference({"a": [[1, 2], [3, 4]], "b": [[1, 2], [3, 4]]}) is None
    assert first_difference({"a": [[1, 2], [3, 4]], "b": [[1, 2], [3, 5]]}) == {"request": 1, "position": 1, "tokens": {"a": 4, "b": 5}}
    assert first_difference({"a": [[1, 2]], "b": [[1]]}) == {"request": 0, "position": 1, "tokens": {"a": 2, "b": None}}


def test_the_console_script_runs_report_compare(tmp_path, capsys):
    paths = []
    for name, target in (("ours", "acme"), ("theirs", "other")):
        paths.append(tmp_path / name / "results.json")
        paths[-1].parent.mkdir()
        paths[-1].write_text(json.dumps(document(SYNTHETIC, target=target)))
    assert cli_main(["report", "compare", str(paths[0]), str(paths[1].parent), "--out", str(tmp_path / "out")]) == 0
    assert "compare: acme vs other, profile smoke, seed 0, 6 cases: 0 differ" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["runs"][1]["source"] == str(paths[1].parent)
    assert (tmp_path / "out" / "compare.html").is_file()
    assert cli_main(["report", "compare", str(paths[0]), str(tmp_path / "nothing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "cannot read" in capsys.readouterr().err
