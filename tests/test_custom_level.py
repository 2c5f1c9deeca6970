"""A level a third party ships (``examples/custom_level``, installed by scripts/install-cpu-env): found by
its entry point, run through the real worker, judged in the referee, reported and gated like the built-in
levels; a broken level declaration stops the suite naming the entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conformance import levels
from conformance.levels import KINDS, LevelError, installed_kinds, kind_of
from conformance.session import ConformanceRun, RunSettings

ROOT = Path(__file__).resolve().parents[1]
custom_level = pytest.importorskip("custom_level.kind", reason="examples/custom_level is not installed: bash scripts/install-cpu-env installs it")
DEVICE_SUM = custom_level.DEVICE_SUM


def test_the_installed_level_is_found_by_its_entry_point_and_owns_its_cases():
    assert DEVICE_SUM in KINDS and DEVICE_SUM in installed_kinds()
    case_id, case = DEVICE_SUM.cases("smoke", 0)[1]
    assert kind_of(case) is DEVICE_SUM and case_id == "device_sum:float32:length=1000;seed=1"
    assert type(case).from_json(json.loads(json.dumps(case.to_json()))) == case


def test_its_judge_allows_float32_rounding_and_fails_bfloat16_accumulation():
    from custom_level.judge import draw, judge

    values = draw(4096, 7)
    assert judge(values, torch.sum(values, dtype=torch.float32).reshape(1))[0]
    assert not judge(values, torch.sum(values).to(torch.bfloat16).float().reshape(1))[0]  # the sum rounded to bfloat16
    assert not judge(values, torch.tensor([float("nan")]))[0]


class _EntryPoint:
    def __init__(self, name: str, loads) -> None:
        self.name, self.value, self.dist, self._loads = name, f"broken_pkg:{name}", None, loads

    def load(self):
        return self._loads()


@pytest.mark.parametrize(("loads", "words"), [
    (lambda: (_ for _ in ()).throw(ImportError("no module named broken_pkg")), "does not import: ImportError"),
    (lambda: "not a kind", "is a str, not a conformance.levels.CaseKind instance"),
    (lambda: DEVICE_SUM, "is named 'device_sum', which another level has"),
])  # fmt: skip
def test_a_broken_level_declaration_stops_the_suite_naming_the_entry_point(monkeypatch, loads, words):
    monkeypatch.setattr(levels, "entry_points", lambda group: [_EntryPoint("device_sum", lambda: DEVICE_SUM), _EntryPoint("zz_broken", loads)])
    with pytest.raises(LevelError, match="zz_broken") as raised:
        installed_kinds()
    assert words in str(raised.value)


@pytest.mark.integration  # starts the target's worker
def test_its_cases_run_in_the_worker_and_are_judged_reported_and_gated(tmp_path):
    run = ConformanceRun(RunSettings(target="hpu-emulated", profile="smoke", report_dir=str(tmp_path)), kinds=(DEVICE_SUM,))
    try:
        document = run.run_all()
    finally:
        run.close()
    assert document["gate"]["passed"], document["gate"]
    assert sorted(r["id"] for r in document["results"]) == sorted(case_id for case_id, _ in DEVICE_SUM.cases("smoke", 0))
    assert {r["level"] for r in document["results"]} == {"device_sum"} and run.executor.restarts == 0
    assert "device_sum" in (tmp_path / "report.html").read_text()


@pytest.mark.integration  # a whole pytest run in a subprocess
def test_a_target_that_patches_torch_in_its_process_fails_the_level_and_the_referee_is_untouched(tmp_path):
    """The target replaces ``torch.sum`` in its own process: the level's half, which runs there, sums wrong;
    the judgement, which sums in float64 in pytest's process, is not moved."""
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--profile=smoke", "-m", "device_sum",
               "--target=misbehaving_targets:SumsInBfloat16", "--report-dir", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert len(results) == 3 and all(r["outcome"] == "fail" and "over the float32 allowance" in r["message"] for r in results), results
