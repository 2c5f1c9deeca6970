"""Progress lines a person can follow on a long run, printed by the process that sees every result.

    [progress] 1200/2223 cases, 0 failures; add_lora_linear 300/420, sgmv_expand 12/96; 9 ops done; elapsed 1m20s, about 40s left

Serially that is the one pytest process; under xdist it is the controller, which receives every
worker's reports (``pytest_runtest_logreport``) and the collected ids
(``pytest_xdist_node_collection_finished``). A line is printed when ``--progress-every`` seconds have
passed since the last one (0: after every case), and once more at the end. A case is counted when its
teardown is reported, so each counts once whatever phase ended it; it counts as a failure when any
phase failed (a known failure is an xfail, not a failure). Cases are grouped by the first part of
their test id (the op, for the op cases).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest


def group_of(nodeid: str) -> str:
    """``test_case[bgmv_shrink-fp16-…]`` → ``bgmv_shrink``; a test without parameters → its name."""
    name = nodeid.rsplit("::", 1)[-1]
    if "[" in name:
        return name.split("[", 1)[1].rstrip("]").split("-", 1)[0]
    return name


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """A pytest plugin object; registered in the controller (or the serial process) only."""

    def __init__(self, config: pytest.Config, every: float, clock=time.monotonic) -> None:
        self.config = config
        self.every = every
        self.clock = clock
        self.start = clock()
        self.last = self.start
        self.totals: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        self.failed_ids: set[str] = set()
        self.finished: set[str] = set()
        self.collected = False

    def _collected(self, nodeids) -> None:
        if not self.collected:  # every xdist worker collects the same ids; count them once
            self.collected = True
            self.totals = Counter(group_of(nodeid) for nodeid in nodeids)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:
            self._collected(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._collected(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and not hasattr(report, "wasxfail"):
            self.failed_ids.add(report.nodeid)
        if report.when != "teardown" or report.nodeid in self.finished:
            return
        self.finished.add(report.nodeid)
        self.done[group_of(report.nodeid)] += 1
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.emit(now)

    def pytest_sessionfinish(self) -> None:
        self.emit(self.clock())

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
        left = "" if not done or done >= total else f", about {duration(elapsed / done * (total - done))} left"
        parts.append(f"; elapsed {duration(elapsed)}{left}")
        return "".join(parts)

    def emit(self, now: float) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        # the line may start in the middle of a row of progress dots; begin a fresh one
        if reporter._tw.width_of_current_line:
            reporter.write("\n")
        reporter.write_line(self.line(now))
