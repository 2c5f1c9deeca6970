"""The suite benchmark: wall time and cases per second of `pytest conformance` on hpu-emulated.

Re-run alone with ``python -m benchmarks suite``; it rewrites only ``docs/benchmarks-suite.md``.

Each run is a fresh ``pytest conformance --target=hpu-emulated --profile=P [-n 2] -m PART`` process,
timed from start to exit (start-up, drawing, collection, the cases, the reports), with its own
report directory; its case count is read from its ``results.json``. The op cases (``-m "not e2e"``)
and the end-to-end cases (``-m e2e``) run separately so that both are visible. Drawn profiles are
cached (``LORA_CONFORMANCE_CACHE``): each benchmark uses a fresh cache directory, so its first run
of a profile is cold (draws with Hypothesis and writes the cache) and later runs are warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .markdown import table

TARGET = "hpu-emulated"
PARTS = {"op cases": "not e2e and not tp", "end-to-end": "e2e", "tensor-parallel": "tp"}


@dataclass(frozen=True)
class SuiteRun:
    profile: str
    workers: int  # 0: serial; else pytest-xdist -n
    part: str  # a key of PARTS, or "all"
    cache: str  # "cold" or "warm"

    def argv(self, report_dir: Path) -> list[str]:
        argv = [sys.executable, "-m", "pytest", "conformance", f"--target={TARGET}", f"--profile={self.profile}",
                "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir)]
        if self.workers:
            argv += ["-n", str(self.workers)]
        if self.part != "all":
            argv += ["-m", PARTS[self.part]]
        return argv

    def command(self) -> str:
        workers = f" -n {self.workers}" if self.workers else ""
        part = f' -m "{PARTS[self.part]}"' if self.part != "all" else ""
        return f"pytest conformance --target={TARGET} --profile={self.profile}{workers}{part}"


def plan(profiles: tuple[str, ...], serial_release: bool = False) -> list[SuiteRun]:
    """Per profile: one cold run of everything with -n 2 (smoke and standard), then warm runs of each part."""
    runs = []
    for profile in profiles:
        if profile != "release":
            runs.append(SuiteRun(profile, 2, "all", "cold"))
        for workers in (0, 2) if profile != "release" or serial_release else (2,):
            runs += [SuiteRun(profile, workers, part, "warm") for part in PARTS]
    return runs


def execute(run: SuiteRun, cache_dir: Path, log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="suite-bench-") as report_dir:
        env = {**os.environ, "LORA_CONFORMANCE_CACHE": str(cache_dir)}
        start = time.perf_counter()
        proc = subprocess.run(run.argv(Path(report_dir)), env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        results = Path(report_dir) / "results.json"
        cases = len(json.loads(results.read_text())["results"]) if results.is_file() else 0
    outcome = {"wall_s": wall, "cases": cases, "exit": proc.returncode}
    if not cases:
        outcome["tail"] = (proc.stdout + proc.stderr)[-600:]
    log(f"[suite] {run.command()} ({run.cache}): {outcome}")
    return outcome


def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares ``seconds = startup + per_case · cases``; None with fewer than two distinct counts."""
    if len({c for c, _ in points}) < 2:
        return None
    n = len(points)
    mean_c = sum(c for c, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    per_case = sum((c - mean_c) * (s - mean_s) for c, s in points) / sum((c - mean_c) ** 2 for c, _ in points)
    return mean_s - per_case * mean_c, per_case


def run_all(profiles: tuple[str, ...], serial_release: bool = False, log=print) -> list[tuple[SuiteRun, dict]]:
    with tempfile.TemporaryDirectory(prefix="suite-bench-cache-") as cache_dir:
        return [(run, execute(run, Path(cache_dir), log)) for run in plan(profiles, serial_release)]


def report(measured: list[tuple[SuiteRun, dict]], command: str, machine_lines: list[str]) -> list[str]:
    lines = ["# Benchmarks: the suite's own wall time", "",
             f"Written by `{command}` (the ops: [benchmarks.md](benchmarks.md)).", "", *machine_lines, "",
             f"Each row is one fresh `pytest` process on the `{TARGET}` target, timed from start to exit "
             "(imports, drawing the profile, collection, the cases, writing every report), one torch thread "
             "per process (the suite's default). *cold*: the profile cache (`LORA_CONFORMANCE_CACHE`) was "
             "empty, so the cases were drawn with Hypothesis and cached; *warm*: drawn cases read from the "
             "cache. Cases per second = cases ÷ wall time.", ""]
    rows = [[run.profile, f"-n {run.workers}" if run.workers else "serial", run.part, run.cache, r["cases"],
             f"{r['wall_s']:.1f} s", f"{r['cases'] / r['wall_s']:.1f}" if r["wall_s"] else "–",
             "pass" if r["exit"] == 0 else f"exit {r['exit']}", f"`{run.command()}`"] for run, r in measured]
    lines += table(["profile", "workers", "part", "cache", "cases", "wall", "cases/s", "gate", "command"], rows) + [""]
    lines += ["## Whole profiles (warm: the sum of the parts)", ""]
    totals = {}
    for run, r in measured:
        if run.cache == "warm":
            t = totals.setdefault((run.profile, run.workers), [0, 0.0, 0])
            t[0] += r["cases"]
            t[1] += r["wall_s"]
            t[2] += 1
    lines += table(["profile", "workers", "cases", "wall (sum of the parts, each paying start-up)"],
                   [[p, f"-n {w}" if w else "serial", c, f"{s:.1f} s"] for (p, w), (c, s, k) in totals.items() if k == len(PARTS)]) + [""]
    lines += ["## How time grows with the number of cases", "",
              "Least-squares fit of wall time against case count over the warm op-case runs of every profile "
              "(same worker count): `wall ≈ start-up + per-case · cases`.", ""]
    fits = []
    for workers in sorted({run.workers for run, _ in measured}):
        points = [(r["cases"], r["wall_s"]) for run, r in measured
                  if run.workers == workers and run.part == "op cases" and run.cache == "warm" and r["cases"]]
        f = fit(points)
        if f:
            fits.append([f"-n {workers}" if workers else "serial", len(points), f"{f[0]:.1f} s", f"{f[1] * 1e3:.1f} ms",
                         f"{1 / f[1]:.0f}" if f[1] > 0 else "–"])
    lines += table(["workers", "runs", "start-up", "per case", "cases/s at scale"], fits) if fits else ["(needs two profiles)"]
    lines += ["", "## Goals", ""]
    for profile, goal in (("smoke", 60), ("standard", 300)):
        cold = [r for run, r in measured if run.profile == profile and run.cache == "cold" and run.workers == 2]
        if cold:
            verdict = "met" if cold[0]["wall_s"] <= goal else "**missed**"
            lines.append(f"- {profile} ≤ {goal} s with `-n 2` (whole profile, one run, cold cache): "
                         f"{cold[0]['wall_s']:.0f} s, {verdict}.")
    op_standard = [r["cases"] for run, r in measured if run.profile == "standard" and run.part == "op cases"]
    e2e_standard = [r["cases"] for run, r in measured if run.profile == "standard" and run.part == "end-to-end"]
    tp_standard = [r["cases"] for run, r in measured if run.profile == "standard" and run.part == "tensor-parallel"]
    if op_standard:
        lines.append(f"- standard holds ≥ 5000 randomized op cases plus the end-to-end and tensor-parallel sets: "
                     f"{op_standard[0]} op cases, {e2e_standard[0] if e2e_standard else '?'} end-to-end cases and "
                     f"{tp_standard[0] if tp_standard else '?'} tensor-parallel cases, "
                     f"{'met' if op_standard[0] >= 5000 else '**missed**'}.")
    return lines + [""]
