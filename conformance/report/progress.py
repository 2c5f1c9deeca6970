"""Progress lines a person can follow on a long run, printed by the process that sees every result.

    [progress] 1200/6537 cases, 0 failures; add_lora_linear 300/360, tp2 3/84; 9 done; elapsed 1m20s, about 1m50s left (estimate; model from a prior)

Serially that is the one pytest process; under xdist it is the controller, which receives every
worker's reports (``pytest_runtest_logreport``) and the collected ids
(``pytest_xdist_node_collection_finished``). A line is printed when ``--progress-every`` seconds have
passed since the last one (0: after every case), and once more at the end. A case is counted when its
teardown is reported, so each counts once whatever phase ended it; it counts as a failure when any
phase failed (a known failure is an xfail, not a failure). Cases are grouped by their id (``group_of``: the op for op cases, ``tp2``/``tp4`` for tensor-parallel
ones, the check for end-to-end ones).

The time left is an estimate, and the line says so. Cases of different levels cost very different
times (an op case about 10 ms, a tensor-parallel or end-to-end case from half a second on the CPU to
seconds on a device), so it is summed per group: each group's cases still to run times the mean time of
that group's finished cases (the reports' own durations, setup to teardown) but its first, which pays
what the group starts (the worker loading the target, a rank pool of its size, a fixture model); for a
group without such a case yet, the mean of its level's, or before there is one, the level's prior
(``LEVEL_PRIORS``). A group not started yet also pays a start: the mean first case of its level's
started groups. The line names the levels still estimated from a prior. A case the target's facts
refuse (``ConformanceRun.support_plan``) and a skipped one (not supported) cost nothing and are left out
of the means. Under xdist the sum is shared among the workers.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable

import pytest

from conformance.journal import case_id_of
from conformance.query import QueryError, parse_id

# Seconds per case of each level before one of its cases has finished, from docs/benchmarks-suite.md
# (hpu-emulated on the 2-core CI machine, serial, warm cache; each part timed alone, start-up included):
LEVEL_PRIORS = {
    "op": 0.01,  # standard op cases: 5,580 in 57.5 s
    "layer": 0.45,  # smoke tensor-parallel cases: 20 in 8.4 s, their rank pools' start included
    "model": 0.6,  # smoke end-to-end cases: 9 in 5.2 s, the fixture models' loads included
}
UNKNOWN_LEVEL = "op"  # a test that is no conformance case (or a run without a plan) counts as an op case


def group_of(nodeid: str) -> str:
    """The group of a case's test: ``test_case[op:bgmv_shrink:…]`` → ``bgmv_shrink``, ``layer:…:tp=2;…`` →
    ``tp2`` (one rank pool per size), ``model:greedy_generation:…`` → ``greedy_generation``, another
    level's case → its level; a test that is no case → its name."""
    case_id = case_id_of(nodeid)
    try:
        parsed = parse_id(case_id) if case_id else None
    except QueryError:
        parsed = None
    if parsed is None:
        return nodeid.rsplit("::", 1)[-1]
    if parsed.level == "layer":
        return f"tp{parsed.param('tp')}"
    return parsed.name if parsed.level in ("op", "model") else parsed.level


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """A pytest plugin object; registered in the controller (or the serial process) only.

    ``plan``: called once the cases are collected, ``{case_id: (level, refused)}`` (``refused``: the
    target's facts say not supported); None counts every test as an op case the target may run.
    ``workers``: the processes running cases at once (xdist's ``-n``), which share the time left.
    """

    def __init__(self, config: pytest.Config, every: float, clock=time.monotonic,
                 plan: Callable[[], dict[str, tuple[str, bool]]] | None = None, workers: int = 1) -> None:
        self.config = config
        self.every = every
        self.clock = clock
        self.plan = plan
        self.workers = max(1, workers)
        self.start = clock()
        self.last = self.start
        self.totals: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        self.failed_ids: set[str] = set()
        self.finished: set[str] = set()
        self.collected = False
        self.level: dict[str, str] = {}  # group → its level
        self.refused: Counter[str] = Counter()  # per group: cases the facts refuse
        self.refused_ids: set[str] = set()
        self.seconds: defaultdict[str, float] = defaultdict(float)  # per test: its phases' durations so far
        self.skipped_ids: set[str] = set()
        self.measured: defaultdict[str, list[float]] = defaultdict(list)  # per group: the durations of the cases that ran

    def _collected(self, nodeids) -> None:
        if self.collected:  # every xdist worker collects the same ids; count them once
            return
        self.collected = True
        nodeids = list(nodeids)
        self.totals = Counter(group_of(nodeid) for nodeid in nodeids)
        plan = self.plan() if self.plan is not None else {}
        for nodeid in nodeids:
            group = group_of(nodeid)
            level, refused = plan.get(case_id_of(nodeid) or "", (UNKNOWN_LEVEL, False))
            self.level.setdefault(group, level)
            if refused:
                self.refused[group] += 1
                self.refused_ids.add(nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:
            self._collected(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._collected(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and not hasattr(report, "wasxfail"):
            self.failed_ids.add(report.nodeid)
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped_ids.add(report.nodeid)
        self.seconds[report.nodeid] += getattr(report, "duration", 0.0) or 0.0
        if report.when != "teardown" or report.nodeid in self.finished:
            return
        self.finished.add(report.nodeid)
        group = group_of(report.nodeid)
        self.done[group] += 1
        if report.nodeid not in self.skipped_ids and report.nodeid not in self.refused_ids:
            self.measured[group].append(self.seconds[report.nodeid])
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.emit(now)

    def pytest_sessionfinish(self) -> None:
        self.emit(self.clock())

    def estimate(self) -> tuple[float, list[str]]:
        """Seconds left (wall, shared among the workers) and the levels still estimated from their prior."""
        finished_refused = Counter(group_of(nodeid) for nodeid in self.finished & self.refused_ids)
        steady: defaultdict[str, list[float]] = defaultdict(list)  # per level: its groups' cases but their first
        starts: defaultdict[str, list[float]] = defaultdict(list)  # per level: its groups' first cases
        for group, seconds in self.measured.items():
            level = self.level.get(group, UNKNOWN_LEVEL)
            steady[level].extend(seconds[1:])
            starts[level].append(seconds[0])
        work, from_prior = 0.0, set()
        for group, total in self.totals.items():
            to_run = total - self.done[group] - (self.refused[group] - finished_refused[group])
            if to_run <= 0:
                continue
            level = self.level.get(group, UNKNOWN_LEVEL)
            measured = self.measured.get(group, [])[1:] or steady.get(level)
            if measured:
                per_case = _mean(measured)
            else:
                per_case = LEVEL_PRIORS.get(level, LEVEL_PRIORS[UNKNOWN_LEVEL])
                from_prior.add(level)
            if group in self.measured or not starts.get(level):
                work += to_run * per_case
            else:  # a group not started pays its start, as its level's started groups did
                work += _mean(starts[level]) + (to_run - 1) * per_case
        return work / self.workers, sorted(from_prior)

    def line(self, now: float) -> str:
        total, done = sum(self.totals.values()), len(self.finished)
        failures = len(self.failed_ids)
        elapsed = now - self.start
        groups = [
            f"{group} {self.done[group]}/{count}"
            for group, count in sorted(self.totals.items())
            if 0 < self.done[group] < count
        ]
        complete = sum(1 for group, count in self.totals.items() if self.done[group] >= count)
        parts = [f"[progress] {done}/{total} cases, {failures} failure{'' if failures == 1 else 's'}"]
        if groups or complete:
            parts.append("; " + ", ".join(groups + ([f"{complete} done"] if complete else [])))
        parts.append(f"; elapsed {duration(elapsed)}")
        if done < total:
            left, from_prior = self.estimate()
            priors = f"; {', '.join(from_prior)} from {'a prior' if len(from_prior) == 1 else 'priors'}" if from_prior else ""
            parts.append(f", about {duration(left)} left (estimate{priors})")
        return "".join(parts)

    def emit(self, now: float) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        # the line may start in the middle of a row of progress dots; begin a fresh one
        if reporter._tw.width_of_current_line:
            reporter.write("\n")
        reporter.write_line(self.line(now))


def _mean(seconds: list[float]) -> float:
    return sum(seconds) / len(seconds)
