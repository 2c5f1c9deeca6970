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

import multiprocessing.util
import os
import subprocess

import pytest
import torch

from conformance import hypothesis_profile

hypothesis_profile.load()
torch.set_num_threads(1)

INTEGRATION_MODULES = {
    "isolation/test_crash_isolation.py", "isolation/test_hostile_messages.py", "isolation/test_referee.py",
    "isolation/test_process_groups.py", "isolation/test_hostile_replies.py", "test_run_refusals.py", "test_cli.py", "test_selfcheck.py", "test_sharding.py", "test_benchmarks.py",
    "report/test_artifacts.py", "report/test_clusters.py", "report/test_compare.py", "report/test_merge_redraw.py",
    "tp/test_tp_plugin.py", "tp/test_tp_pool.py", "e2e/test_e2e_cli.py", "tp/test_tp_hostile_messages.py",
    "targets/test_vllm_cpu_ops_swap.py", "targets/test_target_cuda.py", "ops/test_new_op_checklist.py",
}
CALIBRATION_MODULES = {"verdict/test_systematic_calibration.py", "verdict/test_verdict_calibration.py", "verdict/test_precision_calibration.py"}
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


class StartedAProcess(RuntimeError):
    """A unit test started a process: the unit tier is the fast in-process loop (issue 31: 16 "unit" files
    started processes and the tier took twice its budget)."""


def _refuse_processes(what: str):
    def refuse(*args, **kwargs):
        raise StartedAProcess(f"a unit test started a process ({what}); mark it integration "
                              "(@pytest.mark.integration, or list its module in tests/conftest.py's INTEGRATION_MODULES)")

    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The unit tier holds its rule: every way a test could start a process (subprocess, multiprocessing's
    fork, spawn and forkserver, os.fork and posix_spawn) raises while a unit test sets up, runs and tears
    down. The first integration or calibration test of a module may set up a module fixture that a later
    unit test of the same module uses; that is allowed, since the fixture is then built outside the patch."""
    if not item.get_closest_marker("unit"):
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "_fork_exec", _refuse_processes("subprocess"))
        patch.setattr(multiprocessing.util, "spawnv_passfds", _refuse_processes("multiprocessing's spawn or forkserver"))
        patch.setattr(os, "fork", _refuse_processes("os.fork"))
        patch.setattr(os, "posix_spawn", _refuse_processes("os.posix_spawn"))
        patch.setattr(os, "posix_spawnp", _refuse_processes("os.posix_spawnp"))
        return (yield)
