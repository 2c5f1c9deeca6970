"""What a level sees of the run it is part of: the settings its cases read and where the target runs.

The session (``conformance.session``) makes one :class:`LevelContext` and hands it to every kind's
``run`` and ``after_failure``; a level reads nothing else of the session, so a level (built in or a
third party's) depends on this module and not on the session that drives it. Where the target runs is
made on first use, by the session's providers: a run of op cases only never starts tensor-parallel
ranks, and one without end-to-end cases never reads the model fixtures.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance import journal


def _nothing_provided(what: str) -> Callable[[], Any]:
    def refuse():
        raise RuntimeError(f"this run provides no {what}: a level that needs it is given a context that has it")

    return refuse


REPLAYED_DIR = "replayed"  # under a run's report dir: where its repro lines write their replays' reports


@dataclass(frozen=True)
class LevelContext:
    """The run's settings a level reads, and the providers of where the target runs (each made once, on first use)."""

    target_name: str
    profile: str = "smoke"
    seed: int = 0
    repeat: int = 2  # calls of the target per case attempt (the second compared bit for bit with the first)
    require_deterministic: bool = False
    shrink: bool = False
    case_timeout: float | None = None
    report_dir: Path = Path("reports")
    suite_version: str = ""
    provide_executor: Callable[[], Any] = field(default=_nothing_provided("worker executor"), repr=False)
    provide_tp_executor: Callable[[], Any] = field(default=_nothing_provided("tensor-parallel rank pool"), repr=False)
    provide_e2e_referee: Callable[[], Any] = field(default=_nothing_provided("end-to-end referee"), repr=False)

    @property
    def executor(self):
        """The target's worker (``conformance.isolation``): ``call(level, half, case_id, request, ...)``."""
        return self.provide_executor()

    @property
    def tp_executor(self):
        """The target's rank processes (``conformance.tp.TPExecutor``)."""
        return self.provide_tp_executor()

    @property
    def e2e_referee(self):
        """The end-to-end referee (fixtures, the float64 reference decoder; ``conformance.e2e.run``)."""
        return self.provide_e2e_referee()

    def test_node_id(self, case_id: str) -> str:
        """The pytest node id of a case: every level's cases are one test, ``test_case`` (``conformance.plugin``)."""
        return journal.node_id(case_id)

    def repro_command(self, replay_path: Path) -> str:
        """The command that reruns one replay file alone, into a directory of this run's report dir (:meth:`repro_options`)."""
        return (f"pytest conformance --target={shlex.quote(self.target_name)} --replay {shlex.quote(str(replay_path))} "
                f"{self.repro_options(Path(replay_path).stem)}")

    def repro_options(self, name: str) -> str:
        """What every repro carries besides the target: ``--report-dir`` a directory of its own under this run's
        report dir (``replayed/<name>``, quoted for the shell), so a replay lands beside the run's report, not in
        ``reports/<target>``, and never replaces the run's results.json, report.html and journals."""
        return f"--report-dir {shlex.quote(str(self.report_dir / REPLAYED_DIR / name))}"
