"""A target whose framework takes long to import (JAX behind torchax: 20 s) pays it once per process the run
needs, not once per case, per facts query, per second attempt or per failing tensor-parallel case; and what
it warns and prints goes to the report, with one line in the terminal.

``tests/slow_start_targets.py`` sleeps ``$SLOW_START_SECONDS`` at import and appends one line per import to
``$SLOW_START_COUNT_FILE``: the count is read from there. The measurement with 20 s is in
docs/benchmarks-isolation.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slow_start_targets import ABORT_ENV, COUNT_FILE_ENV, LAST_WORDS, SECONDS_ENV, SlowStart, imports_counted

from conformance.generator import profile_cases
from conformance.isolation.process import IsolatedExecutor
from conformance.targets import TargetError, TargetUnavailable
from conformance.targets.facts import facts_of
from conformance.tp.cases import tp_cases

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration  # each test runs the suite in a process of its own


def op_cases(op: str, count: int) -> list[str]:
    return [case_id for case_id, case in profile_cases("smoke", 0) if case.op == op][:count]


def conformance(target: str, case_ids: list[str], tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``pytest conformance`` on ``case_ids`` (serial), the target's import taking 1 s; the run and the imports it counted."""
    count_file = tmp_path / "imports"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--target=slow_start_targets:{target}",
               "--profile=smoke", "--report-dir", str(tmp_path / "report"), *args,
               *(f"conformance/test_cases.py::test_case[{case_id}]" for case_id in case_ids)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), SECONDS_ENV: "1", COUNT_FILE_ENV: str(count_file)}
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    return completed, imports_counted(count_file)


def test_a_run_of_20_op_cases_imports_the_target_once_however_many_fail(tmp_path):
    failing, passing = op_cases("bgmv_shrink", 10), op_cases("add_lora_linear", 10)
    completed, imports = conformance("WrongShrink", failing + passing, tmp_path, "--isolation=process")
    output = completed.stdout[-3000:] + completed.stderr[-2000:]
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    outcomes = {r["id"]: r["outcome"] for r in document["results"]}
    assert [outcomes[i] for i in failing] == ["fail"] * 10 and [outcomes[i] for i in passing] == ["pass"] * 10, output
    # One: the worker reads the target's facts before it makes the target, so a serial run needs no process of
    # its own for them; it serves every case, and a failing case's second attempt runs on it too. The referee
    # (pytest's process) never imports the target. Before this, two: the facts process and the worker.
    assert len(imports) == 1 and "conformance/isolation/child.py" in imports[0], imports
    assert document["workers"][0]["worker_restarts"] == 0


def test_a_port_whose_sharded_path_raises_starts_its_rank_pool_once(tmp_path):
    cases = [case.case_id for case in tp_cases("smoke", 0) if case.tp_size == 2][:4]
    completed, imports = conformance("RefusesRanks", cases, tmp_path)
    output = completed.stdout[-3000:] + completed.stderr[-2000:]
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    assert {r["outcome"] for r in document["results"]} == {"not supported"} and len(document["results"]) == 4, output
    assert all("the sharded path is not ported yet" in r["message"] for r in document["results"]), output
    # every rank answered each case (none waits in a collective), so the pool stays: its 2 ranks once, plus the
    # worker the facts came from; before, each case ended the pool and the next started 2 new ranks (1 + 4 × 2)
    ranks = [line for line in imports if "conformance/tp/rank.py" in line]
    assert len(ranks) == 2 and len(imports) == 3, imports
    assert document["workers"][0]["tp_pool_starts"] == 1


def test_what_the_target_warns_and_prints_is_in_the_report_and_one_terminal_line(tmp_path):
    cases = op_cases("bgmv_shrink", 3) + op_cases("add_lora_linear", 3)
    completed, _ = conformance("Warns", cases, tmp_path)
    terminal = completed.stdout + completed.stderr
    assert completed.returncode == 0, terminal[-3000:]
    assert "autotuner.cc" not in terminal and "shard_map is deprecated" not in terminal, terminal[-3000:]
    said = [line for line in terminal.splitlines() if line.startswith("target output:")]
    assert said == [f"target output: 6 warning(s) (2 distinct) and 12 line(s) on stdout/stderr (1 distinct) in 6 case(s), not shown "
                    f"here: {tmp_path / 'report'}/report.html#target-output, results.json target_output"], terminal[-3000:]
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    for record in document["results"]:  # each case its own: one warning (once per location per case), two lines (one per call)
        output = record["target_output"]
        assert [(w["category"], w["count"]) for w in output["warnings"]] == [("FrameworkWarning", 1)], output
        assert [line["count"] for line in output["lines"]] == [2] and "autotuner.cc:120]" in output["lines"][0]["text"], output
    summary = document["target_output"]
    assert summary["total"] == {"warnings": 6, "lines": 12, "cases": 6}
    assert sorted((w["where"].rsplit(":", 1)[0].endswith("slow_start_targets.py"), w["cases"]) for w in summary["warnings"]) == [(True, 3)] * 2
    assert summary["lines"][0]["cases"] == 6 and summary["lines"][0]["first_case"] in cases
    page = (tmp_path / "report" / "report.html").read_text()
    assert 'id="target-output"' in page and "jax.experimental.shard_map is deprecated" in page and "no autotuning cache" in page


def test_the_worker_says_an_unknown_or_unavailable_target_as_the_facts_process_did():
    for name, error, words in (("slow_start_targets:NoSuchClass", TargetError, "is not a subclass"),
                               ("no_such_package.module:Target", TargetError, "cannot import module"),
                               ("hpu", TargetUnavailable, None)):  # habana_frameworks is not installed here
        executor = IsolatedExecutor(name, case_timeout=None)
        try:
            with pytest.raises(error, match=words):
                executor.facts()
        finally:
            executor.close()


def test_the_worker_says_the_facts_first_and_serves_the_cases_after_them(tmp_path, monkeypatch):
    monkeypatch.setenv(COUNT_FILE_ENV, str(tmp_path / "imports"))
    executor = IsolatedExecutor("slow_start_targets:SlowStart", case_timeout=None)
    try:
        facts = executor.facts()
        assert facts == facts_of(SlowStart)  # read in the worker, sent as data, the same
        assert executor.device_description() is None  # not loaded yet: the facts come before the target is made
        executor.start()  # running already: no second worker
        assert executor.starts == 1 and len(imports_counted(tmp_path / "imports")) == 1
    finally:
        executor.close()


def test_a_target_whose_import_aborts_is_named_with_the_last_line_it_wrote(monkeypatch):
    monkeypatch.setenv(ABORT_ENV, "1")
    executor = IsolatedExecutor("slow_start_targets:SlowStart", case_timeout=None)
    try:
        with pytest.raises(TargetError) as raised:
            executor.facts()
    finally:
        executor.close()
    message = str(raised.value)
    assert message.startswith("target 'slow_start_targets:SlowStart': its worker process did not say its facts: the worker process ")
    assert "SIGABRT" in message and "went on" not in message and message.endswith(f"the last line it wrote: {LAST_WORDS}"), message
