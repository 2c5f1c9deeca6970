"""Runs the suite refuses to start, with a usage error naming the problem and the fix (exit 4), where it
once went on and left a wrong record or an internal error:

* ``--resume DIR`` with another ``-k``/``-m`` than the interrupted run's, which would leave some of its
  expected cases without a result (the manifest records the selection, ``selection``);
* ``--replay FILE`` whose case names an op this suite does not have (once a KeyError, INTERNALERROR).

Each runs pytest in a subprocess on the `reference` target, as tests/test_cli.py does, on a few
smoke cases.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from test_cli import conformance, error_lines, results

from conformance.cases.replay import write_replay
from conformance.generator import profile_cases
from conformance.ops import OP_SPECS
from conformance.runner import make_values
from conformance.session import ConformanceRun, RunError, RunSettings

SELECTED = "bgmv_shrink and random"  # three smoke cases: one per dtype
OPTIONS = ("--target=reference", "--profile=smoke")


def _as_killed(report_dir: Path, keep: int) -> None:
    """The run as a kill would have left it: ``keep`` results journalled, no results.json."""
    journal = report_dir / "results" / "main.jsonl"
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:keep]))
    (report_dir / "results.json").unlink()


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Path:
    """A run of -k SELECTED, killed after its first result."""
    report_dir = tmp_path_factory.mktemp("interrupted")
    completed = conformance(*OPTIONS, "-k", SELECTED, report_dir=report_dir)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert len(results(report_dir)["expected"]) == 3
    _as_killed(report_dir, keep=1)
    return report_dir


def test_the_manifest_records_the_selection_and_the_hypothesis_version(interrupted):
    manifest = json.loads((interrupted / "run.json").read_text())
    assert manifest["selection"] == {"keyword": SELECTED, "markexpr": "", "node_ids": [], "cases": []}
    assert manifest["hypothesis_version"] == importlib.metadata.version("hypothesis")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (("-k", "bgmv_shrink and scaled"), f"the interrupted run was selected with -k {SELECTED!r}, not -k 'bgmv_shrink and scaled'"),
        (("-m", "kernel"), "the interrupted run was selected with no -m, not -m 'kernel'"),
    ],
    ids=["other-k", "other-m"],
)
def test_resume_with_another_selection_is_a_usage_error_naming_both(interrupted, given, named):
    before = (interrupted / "results" / "main.jsonl").read_text()
    completed = conformance("--resume", str(interrupted), *given, report_dir=interrupted)
    assert completed.returncode == 4, completed.stdout[-2000:] + completed.stderr[-2000:]
    [line] = error_lines(completed)
    assert named in line and f"leave {given[0]} out" in line
    assert (interrupted / "results" / "main.jsonl").read_text() == before  # nothing ran
    assert not (interrupted / "results.json").exists()


def test_resume_with_the_runs_own_selection_completes_it(tmp_path):
    completed = conformance(*OPTIONS, "-k", SELECTED, report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:]
    _as_killed(tmp_path, keep=1)
    resumed = conformance("--resume", str(tmp_path), "-k", SELECTED, report_dir=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    document = results(tmp_path)
    assert document["missing"] == [] and len(document["results"]) == 3 and document["gate"]["passed"]
    assert document["selection"]["keyword"] == SELECTED


def test_a_manifest_without_a_selection_reads_as_none(interrupted, tmp_path):
    """A manifest written before selections were recorded: resumable without -k/-m, refused with one."""
    manifest = json.loads((interrupted / "run.json").read_text())
    del manifest["selection"]
    (tmp_path / "run.json").write_text(json.dumps(manifest))
    assert ConformanceRun._resume(RunSettings(resume=str(tmp_path)))["expected"] == manifest["expected"]
    assert ConformanceRun._resume(RunSettings(resume=str(tmp_path)), {"keyword": "", "markexpr": ""}) is not None
    with pytest.raises(RunError, match=f"selected with no -k, not -k {SELECTED!r}; leave -k out"):
        ConformanceRun._resume(RunSettings(resume=str(tmp_path)), {"keyword": SELECTED})


def test_a_replay_of_an_unknown_op_is_a_usage_error_naming_it(tmp_path):
    case_id, case = profile_cases("smoke", 0)[0]
    path = write_replay(tmp_path / "replays", case_id, case, make_values(case), target="reference")
    document = json.loads(path.read_text())
    document["case"]["op"] = "bgmv_shrink_v2"
    path.write_text(json.dumps(document))
    completed = conformance("--target=reference", "--replay", str(path), report_dir=tmp_path / "report")
    assert completed.returncode == 4, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "INTERNALERROR" not in completed.stdout + completed.stderr
    [line] = error_lines(completed)
    assert "unknown op 'bgmv_shrink_v2'" in line and str(path) in line
    assert all(op in line for op in OP_SPECS)  # the ops it could have meant


def test_resume_with_other_node_ids_is_refused_and_without_any_is_not(interrupted, tmp_path):
    manifest = json.loads((interrupted / "run.json").read_text())
    one = "conformance/test_cases.py::test_case[op:bgmv_shrink:dtype=fp16;slices=1;rank=32;family=random]"
    manifest["selection"] = {"keyword": "", "markexpr": "", "node_ids": [one]}
    (tmp_path / "run.json").write_text(json.dumps(manifest))
    assert ConformanceRun._resume(RunSettings(resume=str(tmp_path)), {"node_ids": [one]}) is not None
    assert ConformanceRun._resume(RunSettings(resume=str(tmp_path)), {"node_ids": []}) is not None
    other = one.replace("dtype=fp16;slices=1;rank=32", "dtype=bf16;slices=1;rank=2")
    with pytest.raises(RunError, match=r"selected with node ids \[.*fp16.*\], not node ids \[.*bf16.*\]; leave node ids out"):
        ConformanceRun._resume(RunSettings(resume=str(tmp_path)), {"node_ids": [other]})
