"""Tensor-parallel cases through the pytest plugin, as vendor CI runs them: marker, records, gate, repro.

Each test runs ``pytest conformance`` in a subprocess on a seeded fault of tests/tp/tp_fault_targets.py
(on ``PYTHONPATH``, so every rank process loads it by name too).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conformance.query import file_name

ROOT = Path(__file__).resolve().parents[2]
FAULT = "--target=tp_fault_targets:ShrinksOnlyRankZero"


def pytest_run(*args: str, report_dir: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``pytest ARGS`` (the test paths among them) in the project root, with the fault targets importable."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def records(report_dir: Path) -> list[dict]:
    return json.loads((report_dir / "results.json").read_text())["results"]


def test_a_rank_fault_fails_the_gate_and_its_repro_reruns_that_one_case(tmp_path):
    completed = pytest_run("conformance", FAULT, "--profile=smoke", "-m", "tp", report_dir=tmp_path / "run")
    assert completed.returncode == 1, completed.stdout[-2000:]
    results = records(tmp_path / "run")
    assert len(results) == 26 and {r["level"] for r in results} == {"layer"}
    failed = [r for r in results if r["outcome"] == "fail"]
    # the shrink runs on rank 0 only: every layer that shrinks on more than one rank loses rank 1's part
    assert failed and all(r["failing_ranks"] and r["repro"] for r in failed)
    assert any("fully_sharded" in r["id"] for r in failed)
    # where the ranks ran: every record, and the report's Run section
    assert {r["placement"]["label"] for r in results} == {"2 ranks on the CPU, gloo collectives", "4 ranks on the CPU, gloo collectives"}
    [row] = re.findall(r"<dt>tensor-parallel ranks</dt><dd>(.*?)</dd>", (tmp_path / "run" / "report.html").read_text())
    assert sorted(row.split("; ")) == ["2 ranks on the CPU, gloo collectives", "4 ranks on the CPU, gloo collectives"]

    first = failed[0]
    command = shlex.split(first["repro"])
    assert command[:2] == ["pytest", f"conformance/test_cases.py::test_case[{first['id']}]"]
    replayed = tmp_path / "run" / "replayed" / file_name(first["id"])
    assert command[-2:] == ["--report-dir", str(replayed)]  # the rerun lands beside the run's report, not over it
    rerun = pytest_run(*command[1:], report_dir=tmp_path / "repro")  # the repro's own --report-dir comes last: it wins
    assert rerun.returncode == 1, rerun.stdout[-2000:]
    [again] = records(replayed)
    assert (again["id"], again["outcome"], again["message"]) == (first["id"], "fail", first["message"])


def test_devices_naming_fewer_devices_than_ranks_share_them_and_the_report_says_so(tmp_path):
    """``--devices=0`` for a target shaped like a GPU (its backend, nccl, refuses shared devices; this torch has
    none): every rank gets device 0 and gloo joins them (tests/tp/shared_device_targets.py checks each rank's device)."""
    env = {"TP_TEST_EXPECTED": "0,0,0,0"}
    completed = pytest_run("conformance", "--target=shared_device_targets:NcclShapedDevice", "--profile=smoke", "--devices=0",
                           "--cases=layer:column:*", "--cases=layer:moe_w2:*", report_dir=tmp_path, env=env)
    assert completed.returncode == 0, completed.stdout[-2000:]
    results = records(tmp_path)
    assert results and all(r["outcome"] == "pass" for r in results)
    assert {r["message"] for r in results} <= {"2 ranks on 1 device, gloo collectives", "4 ranks on 1 device, gloo collectives"}
    assert {r["placement"]["backend"] for r in results} == {"gloo"} and {r["placement"]["device_backend"] for r in results} == {"nccl"}
    [row] = re.findall(r"<dt>tensor-parallel ranks</dt><dd>(.*?)</dd>", (tmp_path / "report.html").read_text())
    assert sorted(row.split("; ")) == ["2 ranks on 1 device, gloo collectives", "4 ranks on 1 device, gloo collectives"]

    wrong = pytest_run("conformance", "--target=shared_device_targets:NcclShapedDevice", "--profile=smoke", "--devices=0,7",
                       "--cases=layer:column:*", report_dir=tmp_path / "wrong", env={**env, "TP_TEST_VISIBLE": "0"})
    assert wrong.returncode != 0 and "--devices names 7, which is not among the cpu devices here (0" in wrong.stdout, wrong.stdout[-2000:]


def test_not_tp_leaves_the_layer_cases_out(tmp_path):
    completed = pytest_run("conformance", "--target=reference", "--profile=smoke", "-m", "not tp", "-k", "bgmv_shrink or tp", report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:]
    results = records(tmp_path)
    assert results and "layer" not in {r["level"] for r in results}
