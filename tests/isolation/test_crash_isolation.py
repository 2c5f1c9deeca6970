"""A backend that crashes, hangs or breaks the calling convention cannot fool the gate.

Each misbehaving target (tests/misbehaving_targets.py) misbehaves in every ``add_lora_linear`` call.
The run holds two such cases and three ``bgmv_shrink`` cases, serial and under ``-n 2``; every time it
must end by itself, exit non-zero, and say in results.json, report.html and junit.xml which cases
failed and how (the failure kind), while the other cases are still judged and pass. Then: a killed run
is rebuilt into a FAIL report naming the cases without a result, and ``--resume`` completes it; a
merge including a broken shard fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.generator import profile_cases

ROOT = Path(__file__).resolve().parents[2]
CASE_TIMEOUT = "4"  # seconds: a correct case of this selection takes well under one

# target name → (outcome, kind, words the message must hold)
MISBEHAVIOURS = {
    "aborts": ("broken", "crashed", "died with signal 6 (SIGABRT) while running this case"),
    "exits": ("broken", "crashed", "exited with status 3 while running this case"),
    "kills-itself": ("broken", "crashed", "died with signal 9 (SIGKILL) while running this case"),
    "loops-forever": ("broken", "timed out", f"did not finish within {CASE_TIMEOUT} s"),
    "blocks-forever": ("broken", "timed out", f"did not finish within {CASE_TIMEOUT} s"),
    "raises": ("broken", "raised", "synapse error 26"),
    "returns-new-tensor": ("fail", "wrote nothing", "wrote nothing"),
}
CLASS_OF = {
    "aborts": "Aborts", "exits": "ExitsTheProcess", "kills-itself": "KillsItself", "loops-forever": "LoopsForever",
    "blocks-forever": "BlocksForever", "raises": "RaisesDeviceError", "returns-new-tensor": "ReturnsANewTensor",
}  # fmt: skip


def selection() -> tuple[list[str], list[str]]:
    """Two add_lora_linear cases (the misbehaving op) and three bgmv_shrink cases of the smoke profile."""
    cases = profile_cases("smoke", 0)
    linear = [case_id for case_id, case in cases if case.op == "add_lora_linear" and case.dtype == "float32"][:2]
    shrink = [case_id for case_id, case in cases if case.op == "bgmv_shrink" and case.dtype == "float32"][:3]
    return linear, shrink


def nodeids(case_ids: list[str]) -> list[str]:
    return [f"conformance/test_cases.py::test_case[{case_id}]" for case_id in case_ids]


def conformance(*args: str, report_dir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir), "--profile=smoke", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def target(name: str) -> str:
    return f"--target=misbehaving_targets:{CLASS_OF[name]}"


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["serial", "xdist"])
@pytest.mark.parametrize("name", list(MISBEHAVIOURS))
def test_a_misbehaving_case_is_recorded_with_its_kind_and_every_other_case_is_judged(tmp_path, name, workers):
    linear, shrink = selection()
    completed = conformance(target(name), f"--case-timeout={CASE_TIMEOUT}", *workers, *nodeids(linear + shrink), report_dir=tmp_path)
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.returncode == 1, output  # ended by itself, with the gate's verdict
    document = json.loads((tmp_path / "results.json").read_text())
    outcome, kind, words = MISBEHAVIOURS[name]
    by_id = {r["id"]: r for r in document["results"]}
    assert sorted(by_id) == sorted(linear + shrink) and document["missing"] == [], output
    for case_id in linear:
        record = by_id[case_id]
        assert (record["outcome"], record["kind"]) == (outcome, kind), record
        assert words in record["message"], record["message"]
    assert all(by_id[case_id]["outcome"] == "pass" for case_id in shrink)
    assert not document["gate"]["passed"] and f"2 case(s) ended {outcome}" in document["gate"]["reasons"]
    report = (tmp_path / "report.html").read_text()
    assert "FAIL" in report and all(case_id in report for case_id in linear) and kind in report
    junit = (tmp_path / "junit.xml").read_text()
    assert f"{outcome} [{kind}]" in junit and all(case_id in junit for case_id in linear)
    if name in ("aborts", "loops-forever"):  # a merge including such a shard fails too
        merged = subprocess.run(
            [sys.executable, "-m", "conformance.report", "merge", str(tmp_path / "results.json"), "--out", str(tmp_path / "merged")],
            cwd=ROOT, capture_output=True, text=True,
        )
        assert merged.returncode == 1 and merged.stdout.startswith("verdict: FAIL"), merged.stdout + merged.stderr


def wait_for(condition, seconds: float) -> None:
    """Until ``condition()`` holds, checking it as the events it waits for land (a file appears, a process
    ends); ``TimeoutError`` after ``seconds``, so that a run that never gets there fails instead of hanging."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {seconds:g} s")
        time.sleep(0.05)


def test_a_killed_run_is_rebuilt_as_fail_naming_the_cases_without_result_and_resume_completes_it(tmp_path):
    linear, shrink = selection()
    ids = shrink[:1] + linear[:1] + shrink[1:]  # one case judged, then the hang, then the rest
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--report-dir", str(tmp_path),
               "--profile=smoke", target("blocks-forever"), "--case-timeout=0", *nodeids(ids)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    started = tmp_path / "hang-started"  # the target creates it as its call starts to block (misbehaving_targets)
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**env, "MISBEHAVE_STARTED_FILE": str(started)}, start_new_session=True)
    try:
        wait_for(lambda: started.exists() or run.poll() is not None, 120)
    except TimeoutError:
        os.kill(run.pid, signal.SIGKILL)
        raise
    assert run.poll() is None, "the run ended although a case hangs without a timeout"
    os.kill(run.pid, signal.SIGKILL)  # as a CI job timeout does
    run.wait()
    assert not (tmp_path / "results.json").exists()

    rebuilt = subprocess.run([sys.executable, "-m", "conformance.report", "html", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert rebuilt.returncode == 1 and rebuilt.stdout.startswith("verdict: FAIL"), rebuilt.stdout + rebuilt.stderr
    document = json.loads((tmp_path / "results.json").read_text())
    assert [r["id"] for r in document["results"]] == shrink[:1]
    assert document["missing"] == ids[1:] and f"{len(ids) - 1} expected case(s) have no result" in document["gate"]["reasons"][0]
    assert f"--resume {tmp_path}" in rebuilt.stdout
    report = (tmp_path / "report.html").read_text()
    assert 'id="missing"' in report and all(case_id in report for case_id in ids[1:])

    # --resume runs only the cases without a result (here with a timeout, so the hang ends) and
    # completes the same report; target, profile and selection come from the interrupted run
    resumed = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--resume", str(tmp_path), f"--case-timeout={CASE_TIMEOUT}"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )
    assert resumed.returncode == 1, resumed.stdout[-3000:]
    assert "1 failed, 2 passed" in resumed.stdout, resumed.stdout[-2000:]
    document = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["id"] for r in document["results"]) == sorted(ids) and document["missing"] == []
    assert {r["id"]: r["kind"] for r in document["results"]}[linear[0]] == "timed out"


def test_resume_refuses_a_directory_without_a_run_and_options_that_contradict_it(tmp_path):
    completed = conformance("conformance", "--resume", str(tmp_path), report_dir=tmp_path / "elsewhere")
    assert completed.returncode == 4 and "run.json does not exist" in completed.stderr, completed.stderr
    linear, shrink = selection()
    assert conformance("--target=hpu-emulated", *nodeids(shrink[:1]), report_dir=tmp_path).returncode == 0
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--resume", str(tmp_path), "--target=reference"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 4 and "--target=hpu-emulated, not reference" in completed.stderr, completed.stderr
    nothing_left = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--resume", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert nothing_left.returncode == 0 and "verdict: PASS" in nothing_left.stdout, nothing_left.stdout[-2000:]


def test_without_isolation_a_dead_xdist_worker_still_leaves_its_case_recorded(tmp_path):
    """``--isolation=none``: the pytest worker itself dies; xdist replaces it and the controller records the case."""
    linear, shrink = selection()
    completed = conformance(target("aborts"), "--isolation=none", "-n", "2", *nodeids(linear[:1] + shrink[:2]), report_dir=tmp_path)
    assert completed.returncode == 1, completed.stdout[-3000:]
    document = json.loads((tmp_path / "results.json").read_text())
    by_id = {r["id"]: r for r in document["results"]}
    assert document["missing"] == [] and sorted(by_id) == sorted(linear[:1] + shrink[:2])
    crashed = by_id[linear[0]]
    assert (crashed["outcome"], crashed["kind"], crashed["worker"]) == ("broken", "crashed", "main")
    assert "pytest worker" in crashed["message"] and all(by_id[i]["outcome"] == "pass" for i in shrink[:2])
