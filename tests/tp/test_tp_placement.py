"""Where tensor-parallel ranks run: ``conformance.tp.placement.place_ranks`` for the shapes a lab has.

No GPU or Gaudi is here, so the decision is one pure function of (ranks, visible devices, device traits,
``--devices``), tested for each shape: 1 GPU and 2 ranks (shared, gloo), 2 GPUs and 4 ranks (round
robin, gloo), 8 GPUs and 2 ranks (nccl), an explicit ``--devices``, a lab's ``CUDA_VISIBLE_DEVICES``,
Gaudi (never shared), the CPU. The runs through real rank processes are in test_tp_pool.py; counting
the devices a runtime sees (a process of its own) is at the end, marked integration.
"""

from __future__ import annotations

import pytest
import torch

from conformance import devices as devices_module
from conformance.devices import visible_device_ids
from conformance.targets.device_traits import DeviceTraits
from conformance.tp.placement import place_ranks

CUDA, HPU, CPU = DeviceTraits.builtin("cuda"), DeviceTraits.builtin("hpu"), DeviceTraits.builtin("cpu")
GPUS = [str(index) for index in range(8)]


def test_two_ranks_on_one_gpu_share_it_and_fall_back_to_gloo():
    placement = place_ranks(2, ["0"], CUDA, None)
    assert placement.devices == ("0", "0") and placement.shared
    assert (placement.backend, placement.device_backend) == ("gloo", "nccl")
    assert placement.label == "2 ranks on 1 device, gloo collectives"
    assert placement.env(1) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_four_ranks_on_two_gpus_take_them_round_robin():
    placement = place_ranks(4, ["0", "1"], CUDA, None)
    assert placement.devices == ("0", "1", "0", "1") and placement.backend == "gloo"
    assert placement.label == "4 ranks on 2 devices, gloo collectives"


def test_two_ranks_on_eight_gpus_get_one_each_and_keep_nccl():
    placement = place_ranks(2, GPUS, CUDA, None)
    assert placement.devices == ("0", "1") and not placement.shared
    assert placement.backend == "nccl" and placement.label == "2 ranks on 2 devices, nccl collectives"
    assert place_ranks(4, GPUS, CUDA, "auto").devices == ("0", "1", "2", "3")


def test_devices_chooses_which_and_may_name_fewer_than_ranks():
    assert place_ranks(2, GPUS, CUDA, ["4", "5", "6", "7"]).devices == ("4", "5")
    shared = place_ranks(4, GPUS, CUDA, ["3"])
    assert shared.devices == ("3",) * 4 and shared.label == "4 ranks on 1 device, gloo collectives"
    assert place_ranks(4, GPUS, CUDA, ["6", "2"]).devices == ("6", "2", "6", "2")  # in the order listed


def test_a_labs_visible_devices_are_the_ones_ranks_use():
    placement = place_ranks(2, ["2", "3"], CUDA, None)  # CUDA_VISIBLE_DEVICES=2,3 where the run started
    assert placement.devices == ("2", "3") and placement.backend == "nccl"


def test_a_device_that_does_not_exist_is_an_error_naming_it_and_those_that_do():
    with pytest.raises(ValueError, match=r"--devices names 7, which is not among the cuda devices here \(0, as "
                                         r"CUDA_VISIBLE_DEVICES selects them\); list only those"):
        place_ranks(2, ["0"], CUDA, ["0", "7"])
    with pytest.raises(ValueError, match=r"no cuda device is visible here .*-m 'not tp'"):
        place_ranks(2, [], CUDA, None)
    with pytest.raises(ValueError, match=r"--devices names 0, 1, which are not among the cuda devices here \(none"):
        place_ranks(2, [], CUDA, ["0", "1"])


def test_where_nothing_counted_the_devices_each_rank_gets_its_own_as_before():
    assert place_ranks(4, None, CUDA, None).devices == ("0", "1", "2", "3")
    assert place_ranks(2, None, CUDA, ["9"]).devices == ("9", "9")  # as given: nothing to check it against


def test_a_gaudi_is_never_shared():
    placement = place_ranks(4, GPUS, HPU, None)
    assert placement.devices == ("0", "1", "2", "3") and placement.backend == "hccl"
    assert placement.env(2) == {"HABANA_VISIBLE_MODULES": "2"}
    assert place_ranks(2, GPUS, HPU, ["4", "5"]).label == "2 ranks on 2 devices, hccl collectives"
    with pytest.raises(ValueError, match=r"tensor parallelism 2 on hpu needs 2 devices, one per rank, because one process "
                                         r"acquires a Gaudi .*1 device \(0\) is here or listed by --devices: list 2, or leave"):
        place_ranks(2, ["0"], HPU, None)
    with pytest.raises(ValueError, match=r"tensor parallelism 4 on hpu needs 4 devices"):
        place_ranks(4, GPUS, HPU, ["0", "1"])


def test_ranks_on_the_cpu_use_gloo_and_no_variable():
    placement = place_ranks(2, None, CPU, None)
    assert placement.devices == (None, None) and placement.variable is None and placement.env(0) is None
    assert placement.backend == "gloo" and not placement.shared
    assert placement.label == "2 ranks on the CPU, gloo collectives"
    # --devices with --device-env on a CPU target: the ranks get the ids (gloo shares a device as it is)
    named = place_ranks(2, None, CPU, ["0"], "SOME_VISIBLE")
    assert named.devices == ("0", "0") and named.env(1) == {"SOME_VISIBLE": "0"}
    assert (named.backend, named.label) == ("gloo", "2 ranks on 1 device, gloo collectives")


def test_another_device_type_needs_a_variable_and_a_backend_and_shares_through_gloo():
    traits = DeviceTraits("xpu", "ZE_AFFINITY_MASK", "xccl")
    assert place_ranks(2, ["0"], traits, None).backend == "gloo"  # not known to accept shared devices
    assert place_ranks(2, ["0", "1"], traits, None).backend == "xccl"
    with pytest.raises(ValueError, match="name it with --device-env=VAR"):
        place_ranks(2, ["0"], DeviceTraits("xpu", None, "xccl"), None)
    assert place_ranks(2, ["0"], DeviceTraits("xpu", None, "xccl"), None, "ZE_AFFINITY_MASK").variable == "ZE_AFFINITY_MASK"
    with pytest.raises(ValueError, match=r"need a torch.distributed backend: the target class states one in device_traits\(\)"):
        place_ranks(2, ["0"], DeviceTraits("xpu", "ZE_AFFINITY_MASK", None), None)


def test_visible_devices_are_the_variables_own_list_where_the_run_set_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_device_ids("cuda", "CUDA_VISIBLE_DEVICES", "unused") == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CUDA's "no device"
    assert visible_device_ids("cuda", "CUDA_VISIBLE_DEVICES", "unused") == []
    # an xdist worker's --devices set the variable to its own device: the devices that exist are those before
    monkeypatch.setattr(devices_module, "_BEFORE_ASSIGNMENT", {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert visible_device_ids("cuda", "CUDA_VISIBLE_DEVICES", "unused") == ["0", "1", "2"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_device_ids("cpu", None, "unused") is None  # the CPU has no ids: nothing is counted


@pytest.mark.integration
def test_the_runtime_counts_the_devices_in_a_process_of_its_own(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    counted = visible_device_ids("cuda", "CUDA_VISIBLE_DEVICES", "conformance.targets.reference")
    assert counted == [str(index) for index in range(torch.cuda.device_count())]  # none on a machine without a GPU
    assert visible_device_ids("nodevice", "NO_VISIBLE", "conformance.targets.reference") is None  # no runtime: unknown
    with pytest.raises(ValueError, match=r"could not count the nodevice devices here .*No module named 'no_such_module'.*--devices"):
        visible_device_ids("nodevice", "NO_VISIBLE", "no_such_module")


def test_a_device_type_torch_does_not_know_is_counted_by_its_runtimes_module(monkeypatch, tmp_path):
    """As Gaudi's: no torch.hpu until habana_frameworks loads, so habana_frameworks.torch.hpu counts them."""
    (tmp_path / "fake_chip_runtime.py").write_text("def device_count():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(devices_module, "RUNTIME_MODULES", {"fakechip": "fake_chip_runtime", "gonechip": "no_such_runtime"})
    assert devices_module.count_devices("fakechip", "conformance.targets.reference") == "3"
    assert devices_module.count_devices("gonechip", "conformance.targets.reference") == "unknown"  # not installed
    assert devices_module.count_devices("otherchip", "conformance.targets.reference") == "unknown"
