"""What judging apart from the target costs: the same cases isolated and in-process, side by side.

Re-run alone with ``python -m benchmarks isolation``; it rewrites only ``docs/benchmarks-isolation.md``
and prints each run and the ratio.

Each round runs the same ``pytest conformance --target=hpu-emulated --profile=P -n 2 --repeat 2 -m PART``
twice, once with ``--isolation=process`` (the default: the target in a worker process, the referee in
pytest's) and once with ``--isolation=none`` (the target imported into pytest's process), alternating
which goes first, so that a change in the machine's load falls on both. A warm-up run first fills the
profile cache, so every timed run reads drawn cases rather than drawing them. Each run is timed from
start to exit, and its CPU time (user + system, of pytest and every process it started) is read from
``wait4``: on a shared machine the CPU time compares better than the wall time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .markdown import table
from .suite import PARTS, TARGET

MODES = ("process", "none")
# Earlier measurements of the same op-case command (standard, -n 2, default --repeat=2, warm cache) on this
# kind of machine (2 cores, shared), kept so that each rewrite of the page shows them beside its own.
EARLIER = (
    ("2026-12-01", "6ef49cf", "the target and the referee in one process, one call per case (before the referee moved out)", "5,580", "39.6 s", "141"),
    ("2026-12-04", "1c9dd89", "isolated, replies pickled, inputs cloned for every call and every oracle run", "6,300", "131.1 s", "48"),
    ("2026-12-04", "1c9dd89", "the same cases with --isolation=none", "6,300", "100.3 s", "63"),
    ("2026-12-05", "42e8fd4", "isolated, replies as data (conformance/wire), repeats judged by their bytes", "6,300", "98.4 s", "64"),
    ("2026-12-05", "42e8fd4", "the same cases with --isolation=none", "6,300", "87.8 s", "72"),
)
# A target slow to import (issue 35: a port on JAX behind torchax took 20 s), measured by hand: the op cases of
# bgmv_shrink in the smoke profile (57) on tests/slow_start_targets.py's SlowStart with SLOW_START_SECONDS=20,
# one fresh pytest process each, 2 shared cores; "imports" counts the processes that imported the target.
START_UP_COMMAND = ("SLOW_START_SECONDS=20 SLOW_START_COUNT_FILE=F PYTHONPATH=tests pytest conformance "
                    "--target=slow_start_targets:SlowStart --profile=smoke -m \"not e2e and not tp\" -k bgmv_shrink")
START_UP = (
    ("2026-12-06", "00dc162", "serial: a facts process, then the worker", "(serial)", "2", "50.0 s", "2.78"),
    ("2026-12-06", "147fef0", "serial: the worker says the facts first", "(serial)", "1", "26.9 s", "2.84"),
    ("2026-12-06", "00dc162", "-n 2: the controller's facts process, then a worker per xdist worker", "-n 2", "3", "52.9 s", "2.72"),
    ("2026-12-06", "147fef0", "-n 2: unchanged (the controller hands its facts to the xdist workers)", "-n 2", "3", "56.8 s", "2.00"),
)
GOAL_CASES_PER_S = 100.0  # issue 31: the standard profile, -n 2, --repeat 2, on an idle 2-core machine
GOAL_RATIO = 1.5  # the isolated run's wall time at most 1.5x the in-process run's


@dataclass(frozen=True)
class IsolationRun:
    profile: str
    part: str  # a key of suite.PARTS, or "all"
    isolation: str  # one of MODES
    workers: int = 2
    repeat: int = 2

    def options(self) -> list[str]:
        options = [f"--target={TARGET}", f"--profile={self.profile}", f"-n{self.workers}", f"--repeat={self.repeat}",
                   f"--isolation={self.isolation}"]
        return options + (["-m", PARTS[self.part]] if self.part != "all" else [])

    def command(self) -> str:
        part = f' -m "{PARTS[self.part]}"' if self.part != "all" else ""
        return (f"pytest conformance --target={TARGET} --profile={self.profile} -n {self.workers} "
                f"--repeat={self.repeat} --isolation={self.isolation}{part}")


def execute(run: IsolationRun, cache_dir: Path, log=print) -> dict:
    """One fresh pytest process: wall time, CPU time of it and its children, cases judged, exit status."""
    with tempfile.TemporaryDirectory(prefix="isolation-bench-") as report_dir:
        argv = [sys.executable, "-m", "pytest", "conformance", *run.options(), "-q", "-p", "no:cacheprovider",
                "--report-dir", report_dir]
        env = {**os.environ, "LORA_CONFORMANCE_CACHE": str(cache_dir)}
        start = time.perf_counter()
        with open(os.devnull, "wb") as sink:
            proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        results = Path(report_dir) / "results.json"
        cases = len(json.loads(results.read_text())["results"]) if results.is_file() else 0
    outcome = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "cases": cases, "exit": proc.returncode}
    log(f"[isolation] {run.command()}: {cases} cases, {wall:.1f} s wall, {outcome['cpu_s']:.1f} s CPU, "
        f"{cases / wall:.1f} cases/s, exit {proc.returncode}")
    return outcome


def run_all(profile: str, parts: tuple[str, ...], rounds: int, log=print) -> list[tuple[IsolationRun, dict]]:
    """``rounds`` alternating pairs per part, after one untimed warm-up that fills the profile cache."""
    measured = []
    with tempfile.TemporaryDirectory(prefix="isolation-bench-cache-") as cache_dir:
        execute(IsolationRun(profile, parts[0], "process", repeat=1), Path(cache_dir), log=lambda line: log(f"{line} (warm-up)"))
        for part in parts:
            for i in range(rounds):
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    run = IsolationRun(profile, part, mode)
                    measured.append((run, {**execute(run, Path(cache_dir), log), "round": i + 1}))
    return measured


def summary(measured: list[tuple[IsolationRun, dict]]) -> list[dict]:
    """Per part: the median wall and CPU time of each mode, cases/s and the isolated/in-process ratio."""
    rows = []
    for part in dict.fromkeys(run.part for run, _ in measured):
        by_mode = {mode: [r for run, r in measured if run.part == part and run.isolation == mode] for mode in MODES}
        if not all(by_mode.values()):
            continue
        wall = {mode: statistics.median(r["wall_s"] for r in rs) for mode, rs in by_mode.items()}
        cpu = {mode: statistics.median(r["cpu_s"] for r in rs) for mode, rs in by_mode.items()}
        cases = by_mode["process"][0]["cases"]
        rows.append({"part": part, "cases": cases, "wall": wall, "cpu": cpu, "cases_per_s": cases / wall["process"],
                     "ratio": wall["process"] / wall["none"], "cpu_ratio": cpu["process"] / cpu["none"],
                     "all_passed": all(r["exit"] == 0 for rs in by_mode.values() for r in rs)})
    return rows


def report(measured: list[tuple[IsolationRun, dict]], command: str, machine_lines: list[str]) -> list[str]:
    lines = ["# Benchmarks: judging apart from the target", "",
             f"Written by `{command}` (the suite's wall time: [benchmarks-suite.md](benchmarks-suite.md)).", "",
             *machine_lines, "",
             "Each row is one fresh `pytest` process on the `hpu-emulated` target with `-n 2` and `--repeat=2` (each "
             "case's target half called twice, the second answer compared bit for bit with the first), the profile "
             "cache warm. `process`: the target runs in a worker process and sends its answers back as data "
             "(`conformance/wire`); `none`: the target is imported into pytest's own process. The two modes "
             "alternate round by round. CPU time is user + system of pytest and all its processes.", ""]
    lines += table(["round", "part", "isolation", "cases", "wall", "CPU", "cases/s", "exit", "command"],
                   [[r["round"], run.part, run.isolation, r["cases"], f"{r['wall_s']:.1f} s",
                     f"{r['cpu_s']:.1f} s", f"{r['cases'] / r['wall_s']:.1f}", r["exit"], f"`{run.command()}`"]
                    for run, r in measured]) + [""]
    lines += ["## Isolated against in-process (medians)", ""]
    rows = summary(measured)
    lines += table(["part", "cases", "wall isolated", "wall in-process", "ratio (wall)", "ratio (CPU)", "cases/s isolated"],
                   [[s["part"], s["cases"], f"{s['wall']['process']:.1f} s", f"{s['wall']['none']:.1f} s",
                     f"{s['ratio']:.2f}×", f"{s['cpu_ratio']:.2f}×", f"{s['cases_per_s']:.1f}"] for s in rows]) + [""]
    lines += ["## Beside earlier rounds", "",
              "The op cases of the standard profile with `-n 2`, measured by hand before this command existed "
              "(pytest's own time, warm cache; the profile grew by the rank-512 and long-batch families between "
              "the first row and the others, which is most of the drop from the first row):", ""]
    lines += table(["date", "commit", "what ran", "cases", "time", "cases/s"], [list(row) for row in EARLIER]) + [""]
    lines += ["## A target slow to start", "",
              "What a run pays for a target whose import takes 20 s (a framework's start-up) is that time per process "
              f"that imports it. Measured by hand: `{START_UP_COMMAND}` (57 cases, 2 cores shared with other jobs, the 1-minute load at the start in "
              "the last column):", ""]
    lines += table(["date", "commit", "what imports the target", "option", "imports", "wall", "load"], [list(row) for row in START_UP]) + [""]
    lines += ["With `-n 2` the controller still reads the facts in a process of its own before xdist starts its workers "
              "(each xdist worker is handed them and imports the target once, in its worker): 20 s on the critical path "
              "that a serial run no longer pays.", ""]
    lines += ["## Goals", ""]
    for s in rows:
        lines.append(f"- {s['part']}: isolated ≥ {GOAL_CASES_PER_S:.0f} cases/s: {s['cases_per_s']:.1f}, "
                     f"{'met' if s['cases_per_s'] >= GOAL_CASES_PER_S else '**missed**'}; isolated within "
                     f"{GOAL_RATIO}× of in-process: {s['ratio']:.2f}×, {'met' if s['ratio'] <= GOAL_RATIO else '**missed**'}; "
                     f"every run's gate {'passed' if s['all_passed'] else '**did not pass**'}.")
    return lines + [""]


def print_ratios(measured: list[tuple[IsolationRun, dict]]) -> None:
    for s in summary(measured):
        print(f"{s['part']}: {s['cases']} cases; isolated {s['wall']['process']:.1f} s ({s['cases_per_s']:.1f} cases/s), "
              f"in-process {s['wall']['none']:.1f} s; ratio {s['ratio']:.2f}x wall, {s['cpu_ratio']:.2f}x CPU")
