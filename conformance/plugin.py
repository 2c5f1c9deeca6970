"""The pytest front end: ``pytest conformance --target=NAME``.

It turns the profile's cases into tests (ids like ``add_lora_linear-bf16-slices3-r16-neg1``), runs each
through ``conformance.runner``, applies the target's expectations, writes a replay for every failing
case, records every result, and at the end applies the gate: the exit code is the verdict.

Outcome → pytest: pass → passed; fail and unexpected pass → failed; broken → error raised by the
target (failed, "broken" in Allure); not supported → skipped with the reason; known failure → xfail.

Under xdist every worker draws the same cases from the same seed, runs its share and appends its
results to ``<report-dir>/results/<worker>.jsonl``; the controller merges them into ``results.json``
and renders ``report.html`` (``conformance.report``). Across machines, ``--shard I/N`` (0-based) keeps
the cases whose index in the profile's list is I modulo N; ``python -m conformance.report merge`` joins
the shards' ``results.json`` files and gates them again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import conformance
from conformance import hypothesis_profile
from conformance.cases.replay import read_replay, write_replay
from conformance.expectations import apply_expectations, load_expectations, shipped_expectations
from conformance.gate import gate_verdict, summarize
from conformance.generator import DEFAULT_PROFILE, PROFILES, profile_cases
from conformance.ops import OP_SPECS
from conformance.report import write_html_report
from conformance.runner import CaseResult, check_values, make_values, run_case
from conformance.shrinking import shrink_failure
from conformance.targets import TargetError, TargetUnavailable, known_targets, load
from conformance.verdict import Outcome

SUITE_VERSION = conformance.__version__


class TargetBroken(Exception):
    """The target raised while running a case (the *broken* outcome, distinct from a numeric failure)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lora-conformance", "LoRA conformance suite")
    group.addoption("--target", help="target to judge: a registered name or package.module:Class")
    group.addoption("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE, help="case set (default: %(default)s)")
    group.addoption("--seed", type=int, default=0, help="run seed: another seed draws other cases (default: 0)")
    group.addoption("--replay", metavar="PATH", help="rerun the single case frozen in this replay file")
    group.addoption("--report-dir", metavar="DIR", help="where results and replays go (default: reports/<target>)")
    group.addoption(
        "--shrink",
        action="store_true",
        help="for every failing case, also search for the smallest case that fails the same way and "
        "write its replay (<id>.shrunk.json)",
    )
    group.addoption(
        "--torch-threads",
        type=int,
        default=1,
        help="CPU threads torch may use per process (default 1: cases are small, and spinning threads of "
        "several workers on few cores slow everything down)",
    )
    group.addoption(
        "--expectations",
        metavar="FILE|none",
        help="known-failures file; 'none' for none (default: the file shipped for the target, if any)",
    )
    group.addoption(
        "--shard",
        metavar="I/N",
        help="run only shard I of N (0-based, 0 <= I < N): the cases whose index in the profile's list "
        "is I modulo N; the same on every machine, merge with `python -m conformance.report merge`",
    )


class ConformanceRun:
    """Everything one pytest process needs to run cases on one target."""

    def __init__(self, config: pytest.Config) -> None:
        option = config.option
        self.replay = option.replay
        self.replay_document: dict | None = None
        self.replay_entry = None
        if self.replay:
            try:
                case_id, case, values, document = read_replay(self.replay)
                check_values(case, values)
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from None
            self.replay_entry = (case_id, case, values)
            self.replay_document = document
        self.target_name = option.target or (self.replay_document or {}).get("target")
        if not self.target_name:
            raise pytest.UsageError(
                f"--target is required; known targets: {', '.join(sorted(known_targets()))} (or package.module:Class)"
            )
        try:
            self.target = load(self.target_name)
        except (TargetError, TargetUnavailable) as exc:
            raise pytest.UsageError(str(exc).splitlines()[0]) from None
        self.profile = option.profile
        self.shrink = option.shrink
        self.seed = option.seed
        self.shard = self._shard(option.shard)
        self.report_dir = Path(option.report_dir or Path("reports") / self.target_name.replace(":", "_").replace("/", "_"))
        self.expectations_path = self._expectations_path(option.expectations)
        try:
            self.expectations = load_expectations(self.expectations_path) if self.expectations_path else ()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.today = dt.date.today()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.results_path = self.report_dir / "results" / f"{worker}.jsonl"

    def _expectations_path(self, value: str | None) -> Path | None:
        if value == "none":
            return None
        if value:
            return Path(value)
        return shipped_expectations(self.target_name)

    @staticmethod
    def _shard(value: str | None) -> tuple[int, int] | None:
        if value is None:
            return None
        index, _, count = value.partition("/")
        if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
            raise pytest.UsageError(f"--shard expects I/N with 0 <= I < N (0-based), got {value!r}")
        return int(index), int(count)

    def entries(self):
        """``(case_id, case, values or None)`` for every case of this run (of its shard, if any)."""
        if self.replay_entry is not None:
            return [self.replay_entry]
        cases = profile_cases(self.profile, self.seed)
        if self.shard:
            index, count = self.shard
            cases = [entry for position, entry in enumerate(cases) if position % count == index]
        return [(case_id, case, None) for case_id, case in cases]

    def repro_command(self, replay_path: Path) -> str:
        return f"pytest conformance --target={self.target_name} --replay {replay_path}"

    def run(self, entry) -> CaseResult:
        case_id, case, values = entry
        values = make_values(case) if values is None else values  # once: the run and a replay share them
        result = run_case(self.target, case, case_id, values)
        result = apply_expectations(result, self.expectations, self.today)
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            path = write_replay(
                self.report_dir / "replays",
                case_id,
                case,
                values,
                target=self.target_name,
                outcome=result.outcome.value,
                message=result.message,
                suite_version=SUITE_VERSION,
            )
            result.replay = str(path)
            result.repro = self.repro_command(path)
            if self.shrink and result.outcome is not Outcome.KNOWN_FAILURE:
                self.add_shrunk_case(result)
        self.record(result)
        return result

    def add_shrunk_case(self, result: CaseResult) -> None:
        smallest = shrink_failure(self.target, result, PROFILES[self.profile].limits)
        if smallest is None:
            result.message += " (shrinking found no smaller case failing the same way)"
            return
        path = write_replay(
            self.report_dir / "replays",
            f"{result.case_id}.shrunk",
            smallest,
            make_values(smallest),
            target=self.target_name,
            shrunk_from=result.case_id,
            suite_version=SUITE_VERSION,
        )
        shape = f"{len(smallest.seq_lens)} sequences, {smallest.num_tokens} tokens, {smallest.num_slots} slots, rank {smallest.max_rank}"
        result.repro = f"{result.repro}\nshrunk ({shape}): {self.repro_command(path)}"

    def record(self, result: CaseResult) -> None:
        self.results_path.parent.mkdir(parents=True, exist_ok=True)
        with self.results_path.open("a") as stream:
            stream.write(json.dumps(result.to_json()) + "\n")

    def about(self) -> dict:
        return {
            "suite_version": SUITE_VERSION,
            "target": self.target_name,
            "profile": self.profile if not self.replay else "replay",
            "seed": self.seed,
            "shard": f"{self.shard[0]}/{self.shard[1]}" if self.shard else None,
            "replay": self.replay,
            "expectations": str(self.expectations_path) if self.expectations_path else None,
            "python": sys.version.split()[0],
        }


_RUN_KEY = pytest.StashKey[ConformanceRun]()
_GATE_KEY = pytest.StashKey[dict]()  # the gate, computed at session finish, printed in the summary


def pytest_configure(config: pytest.Config) -> None:
    hypothesis_profile.load()
    torch.set_num_threads(config.option.torch_threads)
    config.addinivalue_line("markers", "kernel: a kernel-level op case (design level 1)")
    config.addinivalue_line("markers", "wrapper: a PunicaWrapper-level op case (design level 2)")
    run = ConformanceRun(config)
    config.stash[_RUN_KEY] = run
    if not hasattr(config, "workerinput"):  # the controller (or a serial run) starts from a clean slate
        results_dir = run.results_path.parent
        if results_dir.is_dir():
            for stale in results_dir.glob("*.jsonl"):
                stale.unlink()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" in metafunc.fixturenames:
        run = metafunc.config.stash[_RUN_KEY]
        params = [
            pytest.param(entry, id=entry[0], marks=[getattr(pytest.mark, OP_SPECS[entry[1].op].level)])
            for entry in run.entries()
        ]
        metafunc.parametrize("conformance_case", params)


@pytest.fixture(scope="session")
def conformance_run(request: pytest.FixtureRequest) -> ConformanceRun:
    return request.config.stash[_RUN_KEY]


def report_outcome(result: CaseResult) -> None:
    """Turn a result into the pytest outcome (see the module docstring)."""
    repro = f"\nrepro: {result.repro}" if result.repro else ""
    if result.outcome is Outcome.PASS:
        return
    if result.outcome is Outcome.NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.message}")
    if result.outcome is Outcome.KNOWN_FAILURE:
        entry = result.expectation or {}
        pytest.xfail(f"known failure {entry.get('id')}: {entry.get('reason')} ({', '.join(entry.get('upstream', []))}){repro}")
    if result.outcome is Outcome.BROKEN:
        raise TargetBroken(f"{result.message}{repro}")
    pytest.fail(f"{result.outcome.value}: {result.message}{repro}", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):
        return
    run = config.stash[_RUN_KEY]
    results = []
    for path in sorted((run.report_dir / "results").glob("*.jsonl")):
        results.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    results.sort(key=lambda r: r["id"])
    gate = gate_verdict(results, exitstatus)
    document = {**run.about(), "gate": gate, "summary": summarize(results), "results": results}
    run.report_dir.mkdir(parents=True, exist_ok=True)
    (run.report_dir / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    write_html_report(document, run.report_dir / "report.html")
    config.stash[_GATE_KEY] = gate
    if not gate["passed"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _GATE_KEY not in config.stash:
        return
    run, gate = config.stash[_RUN_KEY], config.stash[_GATE_KEY]
    write = terminalreporter.write_line
    terminalreporter.section("LoRA conformance verdict")
    write(f"target {run.target_name}, profile {run.about()['profile']}, seed {run.seed}")
    write(f"verdict: {'PASS' if gate['passed'] else 'FAIL'} ({gate['rule']})")
    for reason in gate["reasons"]:
        write(f"  - {reason}")
    write("outcomes: " + ", ".join(f"{count} {name}" for name, count in gate["counts"].items()))
    for entry in gate["known_failures"]:
        write(f"known failure {entry['id']} ({entry['cases']} cases, expires {entry['expires']}): {', '.join(entry['upstream'])}")
    write(f"results: {run.report_dir / 'results.json'}")
    write(f"report: {run.report_dir / 'report.html'}")
