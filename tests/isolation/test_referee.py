"""The referee cannot be bent by the target: whole runs of targets that try (tests/referee_targets.py).

Each run is a real ``pytest conformance`` session over a few smoke cases: two float32 ``add_lora_linear``
cases, two ``bgmv_shrink``, one ``sgmv_shrink`` and one ``lora_shrink``. The target runs in its worker
process; the values, the oracle and the judgement in the pytest process, which never imports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cases.replay import write_replay
from conformance.generator import profile_cases
from conformance.journal import node_id
from conformance.runner import make_values

ROOT = Path(__file__).resolve().parents[2]


def selection() -> dict[str, list[str]]:
    by_op: dict[str, list[str]] = {}
    for case_id, case in profile_cases("smoke", 0):
        if case.dtype == "float32" and any(slot != -1 for slot in case.token_slots):
            by_op.setdefault(case.op, []).append(case_id)
    return {"add_lora_linear": by_op["add_lora_linear"][:2], "bgmv_shrink": by_op["bgmv_shrink"][:2],
            "sgmv_shrink": by_op["sgmv_shrink"][:1], "lora_shrink": by_op["lora_shrink"][:1]}


def run(target: str, report_dir: Path, *args: str, ids: list[str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    ids = ids if ids is not None else [i for ids in selection().values() for i in ids]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--target={target}", "--profile=smoke",
               "--report-dir", str(report_dir), *args, *map(node_id, ids)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    document = json.loads((report_dir / "results.json").read_text()) if (report_dir / "results.json").exists() else {}
    return completed, {r["id"]: r for r in document.get("results", [])}


def test_the_replay_a_failure_prints_exits_with_that_case_s_own_verdict(tmp_path):
    case_id = selection()["add_lora_linear"][0]
    case = dict(profile_cases("smoke", 0))[case_id]
    path = write_replay(tmp_path / "replays", case_id, case, make_values(case), target="hpu-emulated", outcome="fail")
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--target=hpu-emulated",
               "--replay", str(path), "--report-dir", str(tmp_path / "replayed")]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:]  # it passes on a correct target, so the repro exits 0
    assert "1 passed" in completed.stdout and "verdict: PASS" in completed.stdout
    document = json.loads((tmp_path / "replayed" / "results.json").read_text())
    assert document["expected"] == [case_id] and document["missing"] == []


def test_a_target_that_patches_torch_after_its_first_call_cannot_move_any_verdict(tmp_path):
    completed, results = run("referee_targets:PatchesTorchAfterFirstCall", tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:]
    assert results and {r["outcome"] for r in results.values()} == {"pass"}


def test_a_wrong_target_that_patches_float64_products_to_agree_still_fails(tmp_path):
    completed, results = run("referee_targets:WrongAndPatchesFloat64", tmp_path)
    assert completed.returncode == 1
    for case_id in selection()["add_lora_linear"]:
        assert results[case_id]["outcome"] == "fail" and "numerics" in results[case_id]["kinds"], results[case_id]
    assert all(r["outcome"] == "pass" for i, r in results.items() if i not in selection()["add_lora_linear"])


def test_a_target_that_patches_the_harness_cannot_pass_with_nan_outputs(tmp_path):
    completed, results = run("referee_targets:PatchesTheHarness", tmp_path)
    assert completed.returncode == 1
    for case_id in selection()["add_lora_linear"]:
        assert results[case_id]["outcome"] == "fail" and "nan/inf" in results[case_id]["kinds"], results[case_id]


def test_writes_into_the_metadata_it_was_handed_fail_as_modified_inputs_naming_each(tmp_path):
    completed, results = run("referee_targets:WritesItsMetadata", tmp_path)
    assert completed.returncode == 1
    named = {"bgmv_shrink": ["lora_indices_tensor"], "sgmv_shrink": ["seq_len_tensor"],
             "lora_shrink": ["token_lora_mapping", "lora_ids"]}
    for op, names in named.items():
        for case_id in selection()[op]:
            record = results[case_id]
            assert record["outcome"] == "fail" and record["kinds"] == ["modified an input"], record
            assert all(f"modified the metadata '{name}'" in record["message"] for name in names), record["message"]
    assert all(results[case_id]["outcome"] == "pass" for case_id in selection()["add_lora_linear"])


def test_a_wrapper_that_forgets_its_batch_after_one_call_fails_its_second_call(tmp_path):
    completed, results = run("referee_targets:ForgetsItsBatchAfterOneCall", tmp_path)
    assert completed.returncode == 1
    for case_id in selection()["add_lora_linear"]:
        record = results[case_id]
        assert record["outcome"] == "fail" and "after one update_metadata" in record["message"], record
        assert record["stability"] != "flaky"  # it fails the same way every attempt: a consistent failure


def test_a_target_wrong_one_call_in_twelve_is_labelled_flaky_or_nondeterministic(tmp_path):
    linear = [case_id for case_id, case in profile_cases("smoke", 0) if case.op in ("add_lora_linear", "bgmv_shrink")
              and any(slot != -1 for slot in case.token_slots)][:40]
    completed, results = run("referee_targets:WrongOneCallInTwelve", tmp_path, "-n", "2", ids=linear)
    failed = [r for r in results.values() if r["outcome"] == "fail"]
    # 40 cases of 2 calls: all 80 right has a chance of (11/12)^80 ≈ 0.1 %; a failure must never look consistent
    assert failed and completed.returncode == 1, completed.stdout[-2000:]
    assert all(r["stability"] in ("flaky", "nondeterministic") for r in failed), [(r["id"], r["stability"]) for r in failed]
    document = json.loads((tmp_path / "results.json").read_text())
    assert sum(document["gate"]["stability"].values()) >= len(failed)
    assert "flaky" in (tmp_path / "junit.xml").read_text() or "nondeterministic" in (tmp_path / "junit.xml").read_text()
    assert 'id="determinism"' in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("required", [False, True], ids=["labelled", "required"])
def test_nondeterministic_passes_pass_labelled_unless_determinism_is_required(tmp_path, required):
    """A correct target whose wrapper's last bit differs between calls (split-K order): a pass, labelled."""
    ids = selection()["add_lora_linear"]
    completed, results = run("referee_targets:LastBitWobbles", tmp_path, *(["--require-deterministic"] if required else []), ids=ids)
    for case_id in ids:
        record = results[case_id]
        assert record["stability"] == "nondeterministic" and record["determinism"]["differing_elements"] > 0, record
        assert record["outcome"] == ("fail" if required else "pass"), record
        assert record["kinds"] == (["nondeterministic"] if required else [])
    assert completed.returncode == (1 if required else 0), completed.stdout[-2000:]


def test_the_referee_process_never_imports_the_target(tmp_path):
    """A run driven from a script: after it, the target's module is not in the referee's process."""
    ids = selection()["add_lora_linear"][:1]
    script = f"""
import sys
from conformance.session import ConformanceRun, RunSettings
run = ConformanceRun(RunSettings(target="referee_targets:PatchesTorchAfterFirstCall", profile="smoke", report_dir={str(tmp_path)!r}))
run.entries = lambda entries=run.entries: [e for e in entries() if e[0] in {ids!r}]
document = run.run_all()
assert document["gate"]["passed"], document["gate"]
loaded = sorted(m for m in sys.modules if m.startswith(("referee_targets", "conformance.targets.hpu", "vllm")))
assert not loaded, loaded
assert document["referee"] == "apart from the target"
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    completed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0 and completed.stdout.strip().endswith("ok"), completed.stdout + completed.stderr[-3000:]
