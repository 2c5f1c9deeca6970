"""A tensor-parallel case whose rank raised keeps that rank's whole traceback, formatted in the rank's process:
the suite's frames (``conformance.tp.rank`` through the layer's composition) into the target's, with the
cause it was raised from. A rank that raises while the pool starts leaves its traceback on every case of
that TP size.

The targets are defined here and loaded by name in every rank (the ranks get this process's ``sys.path``).
"""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist
from test_tp_pool import case_of

from conformance.targets.facts import facts_of
from conformance.targets.reference import ReferenceTarget
from conformance.tp.run import TPExecutor
from conformance.verdict import FailureKind, Outcome

FRAME = re.compile(r'^  File "(.+)", line \d+, in (.+)$', re.MULTILINE)

pytestmark = pytest.mark.integration


def _collective_launch() -> None:
    raise OSError("hccl: the communicator is not initialised")


class Rank1RaisesFromACause(ReferenceTarget):
    name = "rank1-raises-from-a-cause"

    def add_lora_linear(self, *args, **kwargs):
        if dist.get_rank() == 1:
            try:
                _collective_launch()
            except OSError as exc:
                raise RuntimeError("the interop layer could not run add_lora_linear on rank 1") from exc
        super().add_lora_linear(*args, **kwargs)


class RaisesWhileLoading(ReferenceTarget):
    name = "raises-while-loading"

    def __init__(self) -> None:
        raise RuntimeError("no device found while loading the target")


def run_one(target: type[ReferenceTarget]):
    executor = TPExecutor(f"test_tp_traceback:{target.__name__}", facts_of(target), case_timeout=60)
    try:
        return executor.run(case_of("column", False, 2))
    finally:
        executor.close()


def test_a_rank_that_raised_leaves_its_traceback_from_the_rank_loop_into_the_target():
    result = run_one(Rank1RaisesFromACause)
    assert (result.outcome, result.kinds, result.failing_ranks) == (Outcome.BROKEN, (FailureKind.RAISED,), (1,)), result.message
    found = [(file.rsplit("/", 1)[-1], function) for file, function in FRAME.findall(result.traceback)]
    assert ("rank.py", "main") in found and ("composition.py", "run_rank") in found, result.traceback
    assert ("test_tp_traceback.py", "_collective_launch") in found and found[-1] == ("test_tp_traceback.py", "add_lora_linear")
    assert "OSError: hccl: the communicator is not initialised" in result.traceback
    assert result.traceback.endswith("RuntimeError: the interop layer could not run add_lora_linear on rank 1")
    assert result.to_json()["traceback"] == result.traceback


def test_a_rank_that_raised_while_the_pool_started_leaves_its_traceback():
    result = run_one(RaisesWhileLoading)
    assert (result.outcome, result.kinds) == (Outcome.BROKEN, (FailureKind.RAISED,)), result.message
    assert "the tensor-parallel pool could not start" in result.message
    assert FRAME.findall(result.traceback)[-1][1] == "__init__", result.traceback
    assert result.traceback.endswith("RuntimeError: no device found while loading the target")
