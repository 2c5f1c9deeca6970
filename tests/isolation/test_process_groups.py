"""Nothing a target starts outlives its worker process (or its tensor-parallel rank).

A target may start processes of its own (a device daemon, a compile server) and never wait for them;
its worker runs in a process group of its own, and when the worker is stopped (at the end of the run,
or killed after a timeout or a crash) the whole group is killed. What was still running is named in
``leftover_processes`` ("pid N (command)"). The targets (tests/grandchild_targets.py) start
``sleep 600`` and write its pid into ``$GRANDCHILD_PID_FILE``; each test checks those pids are gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conformance.isolation import IsolatedExecutor
from conformance.isolation.worker import describe_leftovers, process_group_members

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "isolation") not in sys.path:
    sys.path.insert(0, str(TESTS / "isolation"))

from test_crash_isolation import CASE_TIMEOUT, conformance, nodeids, selection  # noqa: E402

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) ``sleep 600``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X") and command == b"sleep\x00600\x00"


def recorded_pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.fixture
def pid_file(tmp_path, monkeypatch):
    path = tmp_path / "grandchildren.pids"
    monkeypatch.setenv("GRANDCHILD_PID_FILE", str(path))
    monkeypatch.syspath_prepend(str(TESTS))  # the targets' module, for the worker processes too
    yield path
    for pid in recorded_pids(path):  # should a test fail: leave nothing behind either
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)


def test_leftover_helpers_read_the_process_group_and_describe_what_was_left():
    here = process_group_members(os.getpgrp())
    if sys.platform.startswith("linux"):
        assert any(entry.startswith(f"pid {os.getpid()} (") for entry in here), here
    assert not any(entry.startswith(f"pid {os.getpid()} (") for entry in process_group_members(os.getpgrp(), exclude=(os.getpid(),)))
    assert describe_leftovers([]) == ""
    assert describe_leftovers(["pid 7 (sleep 600)", "pid 8 (sleep 600)"]) == (
        "the target left 2 process(es) running: pid 7 (sleep 600), pid 8 (sleep 600); they were killed"
    )


@linux_only
def test_a_process_the_target_started_is_killed_and_named_when_the_worker_closes(pid_file):
    executor = IsolatedExecutor("grandchild_targets:StartsAGrandchildWhenLoaded", case_timeout=60)
    try:
        executor.start()
        executor._await_ready(60, "reading the device")  # the target is loaded: its process runs
        (pid,) = recorded_pids(pid_file)
        deadline = time.monotonic() + 10  # under load, /proc may show the child before its exec of sleep
        while not is_running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_running(pid), "the target's process should run while its worker lives"
    finally:
        executor.close()
    assert not is_running(pid)
    assert executor.leftover_processes == [f"pid {pid} (sleep 600)"]
    assert executor.leftover_description().startswith("the target left 1 process(es) running: pid ")


@linux_only
def test_a_run_whose_target_starts_processes_leaves_none_behind(pid_file, tmp_path):
    linear, shrink = selection()
    completed = conformance("--target=grandchild_targets:StartsAGrandchild", f"--case-timeout={CASE_TIMEOUT}",
                            *nodeids(linear + shrink), report_dir=tmp_path / "report")  # fmt: skip
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    assert {r["id"]: r["outcome"] for r in document["results"]} == dict.fromkeys(linear + shrink, "pass"), output
    pids = recorded_pids(pid_file)
    assert len(pids) >= len(linear), pids  # one per add_lora_linear call (a case may call it more than once)
    assert not [pid for pid in pids if is_running(pid)], "a process the target started outlived the run"


@linux_only
def test_a_hanging_case_whose_target_started_a_process_leaves_none_behind(pid_file, tmp_path):
    linear, shrink = selection()
    started = time.monotonic()
    completed = conformance("--target=grandchild_targets:StartsAGrandchildThenHangs", f"--case-timeout={CASE_TIMEOUT}",
                            *nodeids(linear + shrink), report_dir=tmp_path / "report")  # fmt: skip
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.returncode == 1, output
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    by_id = {r["id"]: r for r in document["results"]}
    assert all((by_id[i]["outcome"], by_id[i]["kind"]) == ("broken", "timed out") for i in linear), output
    assert all(by_id[i]["outcome"] == "pass" for i in shrink)
    pids = recorded_pids(pid_file)
    assert len(pids) == len(linear), pids  # each hanging case's worker started one (its first call hangs), and was killed
    assert not [pid for pid in pids if is_running(pid)], "a process the target started outlived its killed worker"
    assert time.monotonic() - started < 300


# -- tensor-parallel ranks -------------------------------------------------------------------------


def _tp_case():
    from conformance.tp.case import TPCase

    return TPCase("column", False, 2, "float32", seq_lens=(2, 1, 3), seq_slots=(1, -1, 0), num_slots=2,
                  max_rank=8, hidden_size=16, output_slices=(16,), scale=2.0, seed=5)  # fmt: skip


@linux_only
def test_processes_ranks_started_are_killed_and_named_when_the_pool_closes_or_times_out(pid_file):
    from conformance.tp.composition import tensors_of
    from conformance.tp.pool import RankFailure, RankPool
    from conformance.verdict import FailureKind

    pool = RankPool("grandchild_targets:StartsAGrandchild", 2)
    try:
        case = _tp_case()
        pool.run(case, tensors_of(case), 60)
        pids = recorded_pids(pid_file)
        assert len(pids) == 2 and all(is_running(pid) for pid in pids)  # one per rank
    finally:
        pool.close()
    assert not [pid for pid in pids if is_running(pid)]
    assert sorted(pool.leftover_processes) == sorted(f"pid {pid} (sleep 600)" for pid in pids)

    pid_file.unlink()
    hanging = RankPool("grandchild_targets:StartsAGrandchildThenHangs", 2)
    try:
        with pytest.raises(RankFailure) as failure:
            hanging.run(case, tensors_of(case), 3)
        assert failure.value.kind is FailureKind.TIMED_OUT and not hanging.alive
    finally:
        hanging.close()
    pids = recorded_pids(pid_file)
    assert len(pids) == 2 and not [pid for pid in pids if is_running(pid)]
    assert sorted(hanging.leftover_processes) == sorted(f"pid {pid} (sleep 600)" for pid in pids)
