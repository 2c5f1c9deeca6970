"""Tensor-parallel cases through the pytest plugin, as vendor CI runs them: marker, records, gate, repro.

Each test runs ``pytest conformance`` in a subprocess on a seeded fault of tests/tp/tp_fault_targets.py
(on ``PYTHONPATH``, so every rank process loads it by name too).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from conformance.query import file_name

ROOT = Path(__file__).resolve().parents[2]
FAULT = "--target=tp_fault_targets:ShrinksOnlyRankZero"


def pytest_run(*args: str, report_dir: Path) -> subprocess.CompletedProcess:
    """``pytest ARGS`` (the test paths among them) in the project root, with the fault targets importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
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

    first = failed[0]
    command = shlex.split(first["repro"])
    assert command[:2] == ["pytest", f"conformance/test_cases.py::test_case[{first['id']}]"]
    replayed = tmp_path / "run" / "replayed" / file_name(first["id"])
    assert command[-2:] == ["--report-dir", str(replayed)]  # the rerun lands beside the run's report, not over it
    rerun = pytest_run(*command[1:], report_dir=tmp_path / "repro")  # the repro's own --report-dir comes last: it wins
    assert rerun.returncode == 1, rerun.stdout[-2000:]
    [again] = records(replayed)
    assert (again["id"], again["outcome"], again["message"]) == (first["id"], "fail", first["message"])


def test_not_tp_leaves_the_layer_cases_out(tmp_path):
    completed = pytest_run("conformance", "--target=reference", "--profile=smoke", "-m", "not tp", "-k", "bgmv_shrink or tp", report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:]
    results = records(tmp_path)
    assert results and "layer" not in {r["level"] for r in results}
