"""Settings shared by the project's own tests, and their tiers.

* the suite's Hypothesis profile (deadline off, derandomized), also in CI where ``CI=true`` would
  otherwise load Hypothesis' own ``ci`` profile;
* one torch thread per process: the tests run many small ops, often under xdist, where spinning
  OpenMP threads of several processes on two cores cost more than they bring (measured 13× slower);
* the tiers: every test is ``unit`` (in-process, the default loop: ``-m unit``), ``integration`` (whole
  runs of the suite in subprocesses, real browsers, benchmarks) or ``calibration`` (sweeps over many
  seeds and targets, and every test marked ``slow``: a correct target's sweep of a whole profile). A
  module is integration or calibration by the lists below, a single test by its own marker; the
  README's test command runs them all, as CI does.
"""

import pytest
import torch

from conformance import hypothesis_profile

hypothesis_profile.load()
torch.set_num_threads(1)

INTEGRATION_MODULES = {
    "isolation/test_crash_isolation.py", "isolation/test_hostile_messages.py", "isolation/test_referee.py",
    "isolation/test_process_groups.py", "test_run_refusals.py", "test_cli.py", "test_selfcheck.py", "test_sharding.py", "test_benchmarks.py",
    "report/test_artifacts.py", "report/test_clusters.py", "report/test_compare.py", "report/test_merge_redraw.py",
    "tp/test_tp_plugin.py", "tp/test_tp_pool.py", "e2e/test_e2e_cli.py",
}
CALIBRATION_MODULES = {"verdict/test_systematic_calibration.py", "verdict/test_verdict_calibration.py"}
TIERS = ("integration", "calibration")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.relative_to(config.rootpath / "tests").as_posix() if item.path.is_relative_to(config.rootpath / "tests") else ""
        if module in INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)
        elif module in CALIBRATION_MODULES or (item.get_closest_marker("slow") and not item.get_closest_marker("integration")):
            item.add_marker(pytest.mark.calibration)
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.unit)
