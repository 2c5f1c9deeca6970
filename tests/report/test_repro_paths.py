"""Repro lines replay into the run's report dir, and no path a run writes holds a colon.

Every repro (an op case's replay, its shrunk replay, a layer's or model's test node) carries
``--report-dir`` the run's report dir, quoted for the shell, and the target as the user gave it
(``module:Class`` where that is what ``--target`` got), so a replay lands next to the run's report; a
replay file's name is made from its case id without ``:`` or ``;`` (``conformance.query.file_name``),
so nothing under a report dir holds a colon (a Windows drive letter's, an ``scp`` host's).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from test_artifacts import conformance

from conformance.generator.profiles import profile_cases
from conformance.levels.base import CaseKind
from conformance.levels.context import LevelContext
from conformance.query import file_name
from conformance.record import CaseResult
from conformance.verdict import Outcome

TARGET = "fault_targets:ScaleAppliedTwice"  # a module:Class reference: a colon of its own
ONE_CASE = ("--profile=smoke", "-k", "bgmv_shrink and bf16 and random")  # scale 2.3: the doubled scale fails it


def written_paths(report_dir: Path) -> list[str]:
    return [path.relative_to(report_dir).as_posix() for path in report_dir.rglob("*")]


@pytest.mark.integration
def test_a_repro_replays_into_the_runs_report_dir_and_no_written_path_holds_a_colon(tmp_path):
    report_dir = tmp_path / "a run's reports"  # a space and a quote: the shell must get it quoted
    completed = conformance(f"--target={TARGET}", *ONE_CASE, "--shrink", report_dir=report_dir)
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "target fault-scale-twice, profile smoke" in completed.stdout  # the verdict's summary: the short name
    [failed] = json.loads((report_dir / "results.json").read_text())["results"]
    assert ":" in failed["id"] and failed["shrunk"], failed
    replayed_dir = report_dir / "replayed" / Path(failed["shrunk"]["replay"]).stem  # a directory of its own in the run's
    options = f"--report-dir {shlex.quote(str(report_dir / 'replayed' / Path(failed['replay']).stem))}"
    assert failed["repro"].splitlines()[0] == f"pytest conformance --target={TARGET} --replay {shlex.quote(failed['replay'])} {options}"
    assert failed["shrunk"]["repro"].endswith(f"--report-dir {shlex.quote(str(replayed_dir))}") and failed["shrunk"]["repro"] in failed["repro"]
    written = written_paths(report_dir)
    assert "replays" in written and any(path.endswith(".shrunk.json") for path in written)
    assert not [path for path in written if ":" in path or ";" in path], written

    # the repro as a user pastes it: the replay's results land in the run's report dir, beside its report
    command = shlex.split(failed["shrunk"]["repro"])
    assert command[:2] == ["pytest", "conformance"] and command[-2:] == ["--report-dir", str(replayed_dir)]
    run_report = (report_dir / "results.json").read_text()
    replayed = conformance(*command[2:], report_dir=tmp_path / "overridden by the repro's own")
    assert replayed.returncode == 1, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    assert (report_dir / "results.json").read_text() == run_report  # the run's own report is left as it was
    [again] = json.loads((replayed_dir / "results.json").read_text())["results"]
    assert again["id"] == f"{failed['id']}.shrunk" and again["outcome"] == "fail"
    assert not (tmp_path / "overridden by the repro's own").exists()
    assert not [path for path in written_paths(report_dir) if ":" in path or ";" in path]


def test_replay_file_names_of_every_case_are_unique_and_hold_no_colon_or_semicolon():
    ids = [case_id for case_id, _ in profile_cases("smoke")]
    names = {file_name(case_id) for case_id in ids} | {file_name(f"{case_id}.shrunk") for case_id in ids}
    assert len(names) == 2 * len(ids)
    assert not [name for name in names if set(name) & set(":;/\\ '\"")]


def test_a_levels_default_repro_carries_the_report_dir_quoted():
    """The tensor-parallel and end-to-end levels rerun their one test node (``CaseKind.after_failure``)."""
    context = LevelContext("acme.kernels:AcmeTarget", seed=3, report_dir=Path("reports/it's here"))
    case_id, case = profile_cases("smoke")[0]
    result = CaseResult(case_id, case, Outcome.FAIL)
    CaseKind().after_failure(context, result)
    assert shlex.split(result.repro) == [
        "pytest", f"conformance/test_cases.py::test_case[{case_id}]", "--target=acme.kernels:AcmeTarget", "--seed=3",
        "--report-dir", f"reports/it's here/replayed/{file_name(case_id)}",
    ]
    assert shlex.split(context.repro_command(Path("reports/it's here/replays/x.json")))[-2:] == ["--report-dir", "reports/it's here/replayed/x"]
