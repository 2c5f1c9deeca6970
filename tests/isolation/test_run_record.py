"""The run's record on disk (manifest and journals), the worker process, and what a merge checks.

The command-line behaviour with real misbehaving targets is in test_crash_isolation.py; here the
pieces are taken one at a time, without pytest subprocesses.
"""

from __future__ import annotations

import json

import pytest

from conformance import journal
from conformance.generator import profile_cases
from conformance.isolation import IsolatedExecutor, describe_exit
from conformance.isolation.process import main_thread_frames
from conformance.report import MergeError, merge_documents
from conformance.verdict import FailureKind, Outcome


def _manifest(expected: list[str], **fields) -> dict:
    return {
        "suite_version": "0.1.0", "target": "acme", "profile": "smoke", "seed": 0, "shard": None,
        "expected": expected, "shard_cases": expected, "case_list": journal.case_list_summary(expected),
        "environment": {"hypothesis": "6.170.17"}, **fields,
    }  # fmt: skip


def _record(case_id: str, outcome: str = "pass", **fields) -> dict:
    return {"id": case_id, "op": "bgmv_shrink", "dtype": "float32", "level": "kernel", "outcome": outcome, **fields}


class TestJournal:
    def test_results_are_read_back_one_per_case_and_a_cut_line_is_skipped(self, tmp_path):
        main = journal.Journal(tmp_path, "main")
        main.append(_record("a"))
        main.append(_record("b", "fail"))
        main.append(_record("b", "pass"))  # a later line for the same case wins
        journal.Journal(tmp_path, "gw1").append(_record("d"))
        with main.path.open("a") as stream:
            stream.write('{"id": "c", "outc')  # the run was killed in the middle of this write
        records = journal.read_journals(tmp_path)
        assert [(r["id"], r["outcome"]) for r in records] == [("a", "pass"), ("b", "pass"), ("d", "pass")]

    def test_the_document_names_expected_cases_without_result(self):
        document = journal.build_document(_manifest(["a", "b", "c"]), [_record("a"), _record("x")])
        assert document["missing"] == ["b", "c"] and document["unexpected"] == ["x"]
        assert not document["gate"]["passed"]
        assert document["gate"]["reasons"][:2] == [
            "2 expected case(s) have no result: b, c",
            "1 result(s) of cases this run did not expect: x",
        ]

    def test_a_complete_run_passes(self):
        document = journal.build_document(_manifest(["a", "b"]), [_record("a"), _record("b")])
        assert document["gate"]["passed"] and document["missing"] == []

    def test_a_manifest_that_is_missing_or_malformed_is_named(self, tmp_path):
        with pytest.raises(ValueError, match="run.json does not exist"):
            journal.read_manifest(tmp_path)
        (tmp_path / "run.json").write_text(json.dumps({"target": "acme"}))
        with pytest.raises(ValueError, match="lacks the field"):
            journal.read_manifest(tmp_path)
        (tmp_path / "run.json").write_text(json.dumps({**_manifest(["a"]), "expected": "a"}))
        with pytest.raises(ValueError, match="field 'expected'"):
            journal.read_manifest(tmp_path)

    def test_case_ids_come_from_conformance_tests_only(self):
        assert journal.case_id_of("conformance/test_cases.py::test_case[op:bgmv_shrink:dtype=fp32;slices=1;rank=16;family=neg1]") == "op:bgmv_shrink:dtype=fp32;slices=1;rank=16;family=neg1"
        assert journal.case_id_of("conformance/test_cases.py::test_case[greedy_generation-mixed-bf16]") == "greedy_generation-mixed-bf16"
        assert journal.case_id_of("tests/test_x.py::test_y[1]") is None


def judged(executor, case_id, case):
    """One op case through the op level, its target's half in ``executor``, judged here."""
    from types import SimpleNamespace

    from conformance.levels import OP

    return OP.run(SimpleNamespace(executor=executor, repeat=2, require_deterministic=False), case_id, case)


class TestWorkerProcess:
    def test_exits_and_signals_are_described(self):
        assert describe_exit(-6) == "died with signal 6 (SIGABRT)"
        assert describe_exit(-9) == "died with signal 9 (SIGKILL)"
        assert describe_exit(3) == "exited with status 3"

    def test_the_main_threads_innermost_frames_are_read_from_a_stack_dump(self):
        dump = (
            "main thread 0x00007f0000000001\n"
            "Thread 0x00007f0000000002 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
            "Current thread 0x00007f0000000001 (most recent call first):\n"
            '  File "/x/kernels.py", line 12 in spin\n'
            '  File "/x/wrapper.py", line 40 in add_lora_linear\n'
        )
        assert main_thread_frames(dump) == "kernels.py:12 in spin ← wrapper.py:40 in add_lora_linear"
        assert main_thread_frames("main thread 0x1\n") == ""

    @pytest.mark.integration  # starts a process: not the in-process unit loop
    def test_a_crash_costs_one_case_and_the_next_case_runs_in_a_new_worker(self, monkeypatch):
        monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
        cases = dict(profile_cases("smoke", 0))
        linear = next(i for i, c in cases.items() if c.op == "add_lora_linear" and c.dtype == "float32")
        shrink = next(i for i, c in cases.items() if c.op == "bgmv_shrink" and c.dtype == "float32")
        executor = IsolatedExecutor("misbehaving_targets:Aborts", case_timeout=60)
        try:
            crashed = judged(executor, linear, cases[linear])
            assert crashed.outcome is Outcome.BROKEN and crashed.kinds == (FailureKind.CRASHED,)
            assert "SIGABRT" in crashed.message and "in misbehave" in crashed.message
            passed = judged(executor, shrink, cases[shrink])
            assert passed.outcome is Outcome.PASS and executor.restarts == 1
            assert executor.device_description()["device"].startswith("cpu")
        finally:
            executor.close()

    @pytest.mark.integration  # starts a process: not the in-process unit loop
    def test_a_target_that_crashes_while_loading_is_started_once_not_once_per_case(self, monkeypatch):
        monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
        cases = profile_cases("smoke", 0)[:3]
        executor = IsolatedExecutor("misbehaving_targets:AbortsWhileLoading", case_timeout=60)
        try:
            results = [judged(executor, case_id, case) for case_id, case in cases]
        finally:
            executor.close()
        assert all(r.outcome is Outcome.BROKEN and r.kinds == (FailureKind.CRASHED,) for r in results)
        assert "SIGABRT" in results[0].message and "while loading the target" in results[0].message
        assert all("could not be loaded in a worker process" in r.message for r in results[1:])
        assert executor.restarts == 0  # one worker started, none after it

    @pytest.mark.integration  # starts a process: not the in-process unit loop
    def test_a_target_that_cannot_load_breaks_every_case_with_the_reason(self, monkeypatch):
        monkeypatch.setenv("LORA_CONFORMANCE_HPU_BUCKETS", "not-a-policy")
        case_id, case = profile_cases("smoke", 0)[0]
        executor = IsolatedExecutor("hpu-emulated", case_timeout=60)
        try:
            for _ in range(2):
                result = judged(executor, case_id, case)
                assert result.outcome is Outcome.BROKEN and result.kinds == (FailureKind.RAISED,)
                assert "could not be loaded in the worker process" in result.message and "BUCKETS" in result.message
        finally:
            executor.close()


class TestMergeChecks:
    def _document(self, results: list[dict], shard_cases: list[str], whole: list[str], **fields) -> dict:
        manifest = _manifest(shard_cases, case_list=journal.case_list_summary(whole), **fields)
        return journal.build_document(manifest, results)

    def test_duplicated_and_extra_cases_fail_the_merge_by_name(self):
        whole = ["a", "b", "c", "d"]
        first = self._document([_record("a"), _record("b")], ["a", "b"], whole, shard="0/2")
        second = self._document([_record("c"), _record("d"), _record("b")], ["c", "d"], whole, shard="1/2")
        merged = merge_documents([first, second], ["s0.json", "s1.json"], check_cases=False)
        assert not merged["gate"]["passed"] and merged["unexpected"] == [] and merged["duplicated"] == ["b (s0.json and s1.json)"]
        assert "1 case(s) have results in more than one input: b (s0.json and s1.json)" in merged["gate"]["reasons"]
        stray = self._document([_record("c"), _record("d"), _record("z")], ["c", "d"], whole, shard="1/2")
        merged = merge_documents([first, stray], ["s0.json", "s1.json"], check_cases=False)
        assert merged["unexpected"] == ["z"] and not merged["gate"]["passed"]

    def test_shards_that_add_up_pass(self):
        whole = ["a", "b", "c", "d"]
        first = self._document([_record("a"), _record("c")], ["a", "c"], whole, shard="0/2")
        second = self._document([_record("b"), _record("d")], ["b", "d"], whole, shard="1/2")
        merged = merge_documents([first, second], check_cases=False)
        assert merged["gate"]["passed"] and merged["missing"] == []

    def test_different_case_lists_or_hypothesis_versions_are_refused(self):
        first = self._document([_record("a")], ["a"], ["a", "b"], shard="0/2")
        other_list = self._document([_record("b")], ["b"], ["a", "b", "c"], shard="1/2")
        with pytest.raises(MergeError, match="another case list"):
            merge_documents([first, other_list], ["s0.json", "s1.json"], check_cases=False)
        other_hypothesis = self._document([_record("b")], ["b"], ["a", "b"], shard="1/2", environment={"hypothesis": "7.0.0"})
        with pytest.raises(MergeError, match="different Hypothesis versions.*6.170.17 in s0.json, 7.0.0 in s1.json"):
            merge_documents([first, other_hypothesis], ["s0.json", "s1.json"], check_cases=False)


class TestARunWithoutPytest:
    @pytest.mark.integration  # a whole run in a subprocess
    def test_a_script_drives_a_whole_run_and_gets_the_same_document(self, tmp_path):
        import subprocess
        import sys

        script = (
            "import sys, json\n"
            "from conformance.session import ConformanceRun, RunSettings\n"
            f"run = ConformanceRun(RunSettings(target='reference', profile='smoke', shard='0/24', report_dir={str(tmp_path)!r}))\n"
            "document = run.run_all()\n"
            "assert 'pytest' not in sys.modules, 'the run imported pytest'\n"
            "print(json.dumps({'passed': document['gate']['passed'], 'results': len(document['results']), 'missing': document['missing']}))\n"
        )
        completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr[-3000:]
        summary = json.loads(completed.stdout.splitlines()[-1])
        assert summary["passed"] and summary["results"] > 20 and summary["missing"] == []
        written = json.loads((tmp_path / "results.json").read_text())
        assert written["shard"] == "0/24" and len(written["expected"]) == summary["results"]
        assert (tmp_path / "report.html").is_file() and (tmp_path / "run.json").is_file()
