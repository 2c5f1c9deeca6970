"""Targets whose device type says which device each rank must see, to run ranks that share a device on the CPU.

``conformance.tp.placement`` decides each rank's device and backend; on a machine without a GPU the
suite still runs that decision end to end through these: their device type is the CPU, but they name a
visible-devices variable (``TP_TEST_VISIBLE``) and, like CUDA, a backend that refuses ranks sharing a
device (nccl, which this CPU build of torch does not even have: a pool that used it would not start).
Each rank checks, in every call, that it sees exactly the device ``TP_TEST_EXPECTED`` lists for its rank.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from tp_fault_targets import ZeroesNoAdapterRows

from conformance.targets.device_traits import DeviceTraits
from conformance.targets.reference import ReferenceTarget

VISIBLE, EXPECTED = "TP_TEST_VISIBLE", "TP_TEST_EXPECTED"


class NcclShapedDevice(ReferenceTarget):
    name = "nccl-shaped-device"
    description = "the reference; its device names TP_TEST_VISIBLE and nccl (tests only)"

    @classmethod
    def device_traits(cls) -> DeviceTraits:
        return DeviceTraits("cpu", VISIBLE, "nccl")

    def update_metadata(self, mapping) -> None:
        expected = os.environ[EXPECTED].split(",")[dist.get_rank()]
        if os.environ.get(VISIBLE) != expected:
            raise RuntimeError(f"rank {dist.get_rank()} sees {VISIBLE}={os.environ.get(VISIBLE)!r}, expected {expected!r}")
        super().update_metadata(mapping)



class ZeroesNoAdapterRowsOnOneDevice(ZeroesNoAdapterRows, NcclShapedDevice):
    """A failing layer on shared devices (tp_fault_targets' fault): its message says where its ranks ran."""

    name = "zeroes-no-adapter-rows-on-one-device"
