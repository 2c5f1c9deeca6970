"""The HPU targets: registration, availability messages, the smoke profile, and the device layer.

Without a Gaudi, the device layer is exercised with stand-ins: a fake lazy runtime (``mark_step`` after
every op, HPU-graph wrapping of every core function) and, in a subprocess, a fake ``habana_frameworks``
package that records the environment it was imported with.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
from profile_runs import run_profile

from conformance.generator import profile_cases
from conformance.reference import LoRAMapping
from conformance.runner import run_case
from conformance.targets import TargetUnavailable, load, resolve
from conformance.targets.hpu import BucketPolicy, HpuEmulatedGatherTarget, HpuEmulatedTarget, LoRAEngine
from conformance.targets.hpu.device import CpuDeviceLayer, HpuDeviceLayer, HpuRuntime, graphs_requested, requested_mode
from conformance.targets.hpu.device import _probe_placement as probe_placement
from conformance.targets.hpu.vllm_gaudi import VllmHpuTarget
from conformance.targets.registry import BUILTIN_TARGETS
from conformance.verdict import Outcome

HPU_NAMES = ("hpu", "hpu-gather", "hpu-emulated", "hpu-emulated-gather", "vllm-hpu")
no_bridge = importlib.util.find_spec("habana_frameworks") is None


# -- registration and availability -------------------------------------------------------------


def test_registered_names_resolve_to_the_hpu_targets():
    assert set(HPU_NAMES) <= set(BUILTIN_TARGETS)
    for name in HPU_NAMES:
        assert resolve(name).name == name


@pytest.mark.skipif(not no_bridge, reason="habana_frameworks is installed here")
@pytest.mark.parametrize("name", ["hpu", "hpu-gather"])
def test_loading_hpu_without_the_bridge_names_habana_frameworks_in_one_line(name):
    with pytest.raises(TargetUnavailable) as raised:
        load(name)
    message = str(raised.value)
    assert "\n" not in message and message.strip() == message
    assert "habana_frameworks" in message and "Gaudi" in message and "not on PyPI" in message
    assert "habana_frameworks" not in " ".join(sys.modules)


@pytest.mark.skipif(not no_bridge, reason="habana_frameworks is installed here")
def test_loading_vllm_hpu_names_the_plugin_and_the_bridge():
    with pytest.raises(TargetUnavailable) as raised:
        load("vllm-hpu")
    message = str(raised.value)
    assert "\n" not in message
    assert "vllm_gaudi" in message and "habana_frameworks" in message


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_no_module_of_the_suite_imports_the_habana_stack():
    """Import every module under conformance/ in a fresh interpreter, then ask every HPU target's
    ``check_available`` (which may only look for the bridge, not import it, when it is missing)."""
    script = textwrap.dedent(
        """
        import importlib, importlib.util, pkgutil, sys
        import conformance
        for module in pkgutil.walk_packages(conformance.__path__, "conformance."):
            importlib.import_module(module.name)
        import conformance.targets.hpu
        forbidden = {"habana_frameworks", "vllm_gaudi", "vllm_hpu_extension"}
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
        assert not loaded, loaded
        if importlib.util.find_spec("habana_frameworks") is None:
            from conformance.targets import TargetUnavailable, resolve
            for name in ("hpu", "hpu-gather", "hpu-emulated", "hpu-emulated-gather", "vllm-hpu"):
                try:
                    resolve(name).check_available()
                except TargetUnavailable:
                    pass
            loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
            assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True)


# -- the smoke profile through the runner ------------------------------------------------------


@pytest.mark.slow  # every smoke case
@pytest.mark.parametrize("target_class", [HpuEmulatedTarget, HpuEmulatedGatherTarget])
def test_emulated_targets_pass_the_smoke_profile(target_class):
    target = target_class()
    started = time.perf_counter()
    outcomes, failures = run_profile(target, profile_cases("smoke"))
    assert not failures, failures[:10]
    assert outcomes[Outcome.PASS] > 500
    print(f"{target.name}: {outcomes[Outcome.PASS]} cases pass in {time.perf_counter() - started:.1f}s")


# -- the device layer, with a stand-in runtime -------------------------------------------------


class FakeBridge:
    """What the layer uses of ``habana_frameworks.torch`` and ``.core``, recording the calls."""

    def __init__(self) -> None:
        self.mark_steps = 0
        self.synchronized = 0
        self.captured = []
        self.hpu = SimpleNamespace(wrap_in_hpu_graph=self.wrap_in_hpu_graph)

    def mark_step(self) -> None:
        self.mark_steps += 1

    def synchronize(self) -> None:
        self.synchronized += 1

    def wrap_in_hpu_graph(self, module, disable_tensor_cache=False):
        assert isinstance(module, torch.nn.Module) and disable_tensor_cache
        self.captured.append(module)
        return module


def lazy_layer(hpu_graphs: bool) -> tuple[HpuDeviceLayer, FakeBridge]:
    bridge = FakeBridge()
    runtime = HpuRuntime(bridge, bridge, lazy=True, device=torch.device("cpu"), synchronize=bridge.synchronize)
    return HpuDeviceLayer(runtime, None, hpu_graphs), bridge


@pytest.mark.parametrize("hpu_graphs", [False, True])
def test_lazy_mode_marks_a_step_after_every_op_and_graphs_wrap_every_core_function(hpu_graphs):
    layer, bridge = lazy_layer(hpu_graphs)
    target = HpuEmulatedTarget()
    target.engine = LoRAEngine("mask", BucketPolicy(), layer)
    cases = [(cid, c) for cid, c in profile_cases("smoke") if c.family in ("neg1", "slices", "bias")]
    for case_id, case in cases:
        result = run_case(target, case, case_id, runs=1)
        assert result.outcome is Outcome.PASS, (case_id, result.message)
    calls = sum(1 for _, case in cases if case.op not in ("lora_shrink", "lora_expand") or any(s != -1 for s in case.seq_slots))
    # One mark_step per op call (lora_* return early when no row has an adapter), one more per synchronize.
    assert bridge.synchronized == len(cases)
    assert bridge.mark_steps == calls + len(cases)
    # 4 variant functions + 5 writeback functions (merge_blocks: the grouped MoE variant writes from its block layout)
    assert len(bridge.captured) == (9 if hpu_graphs else 0)


def test_hpu_graphs_need_lazy_mode():
    bridge = FakeBridge()
    runtime = HpuRuntime(bridge, bridge, lazy=False, device=torch.device("cpu"), synchronize=bridge.synchronize)
    with pytest.raises(TargetUnavailable, match="lazy mode"):
        HpuDeviceLayer(runtime, "eager", hpu_graphs=True)
    assert HpuDeviceLayer(runtime, "compile").mode == "compile"


def test_a_result_off_the_device_is_refused():
    bridge = FakeBridge()
    layer = HpuDeviceLayer(HpuRuntime(bridge, bridge, False, torch.device("hpu"), bridge.synchronize), "eager")
    with pytest.raises(RuntimeError, match="landed on cpu"):
        layer.check_placement(torch.zeros(1))
    CpuDeviceLayer().check_placement(torch.zeros(1))


def test_the_device_probe_runs_both_variants_math():
    """On the CPU the probe (the op set of both variants, run once when the runtime loads) succeeds."""
    bridge = FakeBridge()
    probe_placement(HpuRuntime(bridge, bridge, True, torch.device("cpu"), bridge.synchronize), "hpu")
    assert bridge.mark_steps == 1


FAKE_BRIDGE_FILES = {
    "habana_frameworks/__init__.py": "",
    "habana_frameworks/torch/__init__.py": """
        import os, types, torch
        ENV_AT_IMPORT = {k: os.environ.get(k) for k in ("PT_HPU_PLACE_ON_CPU", "PT_HPU_LAZY_MODE")}
        torch.hpu = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda: None)
        hpu = types.SimpleNamespace(wrap_in_hpu_graph=lambda module, **kw: module)
        """,
    "habana_frameworks/torch/core.py": "def mark_step(device_str='', sync=False):\n    pass\n",
    "habana_frameworks/torch/utils/__init__.py": "",
    "habana_frameworks/torch/utils/internal.py": """
        import os
        def is_lazy():
            return os.environ.get("PT_HPU_LAZY_MODE") == "1"
        """,
}


SCENARIOS = """
    import os, sys
    from conformance.targets import TargetUnavailable, load
    from conformance.targets.hpu import device

    def fresh(**env):
        # A new process, as far as the bridge and the runtime memo are concerned.
        for name in [m for m in sys.modules if m.split(".")[0] == "habana_frameworks"]:
            del sys.modules[name]
        device._RUNTIME = None
        for key in [k for k in os.environ if k.startswith(("PT_HPU", "LORA_CONFORMANCE_HPU"))]:
            del os.environ[key]
        os.environ.update(env)

    def refused(call, text):
        try:
            call()
        except TargetUnavailable as exc:
            assert text in str(exc) and "\\n" not in str(exc), exc
        else:
            raise AssertionError(f"expected TargetUnavailable mentioning {text!r}")

    probe = device._probe_placement
    device._probe_placement = lambda runtime, target: None  # the fake bridge has no device to probe
    for mode, lazy_env, other in (("lazy", "1", "compile"), ("compile", "0", "lazy"), ("eager", "0", "lazy")):
        fresh()
        runtime = device.load_runtime(mode)
        import habana_frameworks.torch as bridge
        assert bridge.ENV_AT_IMPORT == {"PT_HPU_PLACE_ON_CPU": "none", "PT_HPU_LAZY_MODE": lazy_env}, bridge.ENV_AT_IMPORT
        assert runtime.lazy == (mode == "lazy")
        refused(lambda: device.load_runtime(other), "already loaded")

    fresh()  # someone imported the bridge before the target could refuse the CPU fallback
    import habana_frameworks.torch
    refused(lambda: load("hpu"), "PT_HPU_PLACE_ON_CPU=none")

    device._probe_placement = probe
    fresh()  # the fake bridge registers no real 'hpu' device: the probe op fails, the target is unavailable
    refused(lambda: load("hpu"), "probe op failed")
    print("ok")
"""


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_the_runtime_is_configured_before_the_bridge_loads(tmp_path):
    """Against a fake ``habana_frameworks``: the environment it sees at import (CPU fallback refused,
    lazy flag per mode), mode changes after loading refused, a bridge loaded by someone else without
    ``PT_HPU_PLACE_ON_CPU=none`` refused, a failing device probe reported as unavailable."""
    for path, text in FAKE_BRIDGE_FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    script = "import sys\nsys.path.insert(0, sys.argv[1])\n" + textwrap.dedent(SCENARIOS)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_the_mode_comes_from_the_option_then_the_environment(monkeypatch):
    for key in ("LORA_CONFORMANCE_HPU_MODE", "PT_HPU_LAZY_MODE"):
        monkeypatch.delenv(key, raising=False)
    assert requested_mode() is None  # the bridge's own default
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert requested_mode() == "lazy"
    monkeypatch.setenv("LORA_CONFORMANCE_HPU_MODE", "compile")
    assert requested_mode() == "compile"
    assert requested_mode("eager") == "eager"
    with pytest.raises(TargetUnavailable, match="not one of"):
        requested_mode("fast")
    monkeypatch.setenv("LORA_CONFORMANCE_HPU_GRAPHS", "1")
    assert graphs_requested() and not graphs_requested(False)


# -- vllm-hpu: the runner's part, with a stand-in plugin ---------------------------------------


class FakeLoraMask:
    mask = None

    @staticmethod
    def setLoraMask(mask):
        FakeLoraMask.mask = mask


class FakePunicaWrapperHPU:
    """Records the arguments and the global mask in force at each call (current plugin signature)."""

    def __init__(self, max_num_batched_tokens, max_batches, device):
        self.calls = []

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size):
        self.metadata = (mapping, lora_index_to_id, max_loras)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None):
        self.calls.append(("linear", FakeLoraMask.mask, (scale, output_slices)))

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None):
        self.calls.append(("logits", FakeLoraMask.mask, (scale,)))


class OlderFakePunicaWrapperHPU(FakePunicaWrapperHPU):
    """The 2024 plugin signature: lora_bias_stacked positional before scale."""

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, scale, output_slices, *, buffer=None):
        self.calls.append(("linear", FakeLoraMask.mask, (lora_bias_stacked, scale, output_slices)))


@pytest.mark.integration  # starts a process: not the in-process unit loop
@pytest.mark.parametrize("wrapper_class", [FakePunicaWrapperHPU, OlderFakePunicaWrapperHPU])
def test_vllm_hpu_sets_the_token_and_logits_masks_as_the_runner_does(wrapper_class):
    target = object.__new__(VllmHpuTarget)  # no Gaudi here: skip check_available
    target.device, target.layer = torch.device("cpu"), CpuDeviceLayer()
    target.wrapper_class, target.mask_holder = wrapper_class, FakeLoraMask
    L, R = 3, 2
    mapping = LoRAMapping((0, 0, -1, 2, 2), (0, -1, 2), (2, 1, 2), True, L)
    target.update_metadata(mapping)
    assert target.wrapper.metadata[1:] == ([1, 2, 3], L + 1)
    a, b = torch.zeros(L, 1, R, 8, dtype=torch.bfloat16), torch.zeros(L, 1, 6, R, dtype=torch.bfloat16)
    target.add_lora_linear(torch.zeros(5, 6), torch.zeros(5, 8), (a,), (b,), 1.0, (6,))
    target.add_lora_logits(torch.zeros(3, 6), torch.zeros(3, 8), a, b, 1.0)
    (_, token_mask, linear_args), (_, logits_mask, _) = target.wrapper.calls
    block = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bfloat16)
    assert token_mask.dtype == torch.bfloat16  # the LoRA dtype, as create_lora_mask makes it
    assert torch.equal(token_mask, block[[0, 0, 1, 2, 2]])
    assert torch.equal(logits_mask, block)  # one row per sampled row
    if wrapper_class is OlderFakePunicaWrapperHPU:
        assert linear_args == (None, 1.0, (6,))
