"""What the referee knows of a target without importing it (``conformance.targets.facts``), and the
device facts a target class states (``Target.device_traits``, ``describe_device``)."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.isolation.local import LocalExecutor
from conformance.targets import TargetError, TargetUnavailable
from conformance.targets.device_traits import DeviceTraits
from conformance.targets.facts import TargetFacts, facts_of, probe
from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.tp.cases import tp_cases
from conformance.tp.run import unsupported_reason


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_facts_are_read_in_a_process_of_their_own_and_match_the_class():
    read = probe("hpu-emulated")
    assert read == facts_of(HpuEmulatedTarget)
    assert (read.device_type, read.distributed_backend, read.visible_devices_env) == ("cpu", "gloo", None)
    assert read.defines("add_lora_linear") and read.defines("update_metadata") and read.claims("bfloat16")
    assert TargetFacts.from_json(read.to_json()) == read


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_an_unknown_or_unavailable_target_is_said_as_such():
    with pytest.raises(TargetError, match="unknown target 'nope'"):
        probe("nope")
    with pytest.raises(TargetError, match="cannot import module"):
        probe("no_such_package.module:Target")
    with pytest.raises(TargetUnavailable):
        probe("hpu")  # habana_frameworks is not installed here


class NewDeviceTarget(HpuEmulatedTarget):
    """A target on a device type the suite does not know: it states its traits and describes its device."""

    name = "new-device"

    @classmethod
    def device_traits(cls) -> DeviceTraits:
        return DeviceTraits("mychip", "MYCHIP_VISIBLE_CARDS", None)

    def describe_device(self) -> dict:
        return {"device": "mychip: card 7", "driver": "3.1"}


def test_a_new_device_type_states_its_traits_and_its_tensor_parallel_cases_are_not_supported():
    facts = facts_of(NewDeviceTarget)
    assert (facts.device_type, facts.visible_devices_env, facts.distributed_backend) == ("mychip", "MYCHIP_VISIBLE_CARDS", None)
    reason = unsupported_reason(facts, tp_cases("smoke", 0)[0])
    assert "no torch.distributed backend" in reason and "device_traits()" in reason
    assert unsupported_reason(dataclasses.replace(facts, distributed_backend="gloo"), tp_cases("smoke", 0)[0]) is None


def test_the_device_description_is_the_targets_own_where_it_gives_one(monkeypatch):
    executor = LocalExecutor("hpu-emulated")
    assert executor.device_description()["device"].startswith("cpu: ")
    monkeypatch.setattr(executor, "target", NewDeviceTarget())
    assert executor.device_description() == {"device": "mychip: card 7", "driver": "3.1"}
