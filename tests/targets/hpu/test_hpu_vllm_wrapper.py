"""The HPU implementation as a subclass of vLLM's ``PunicaWrapperBase`` (needs vLLM; CPU device).

* the class derives from the installed vLLM's base and instantiates;
* every smoke case of the wrapper methods passes through it (the MoE ones in vLLM's add_lora_w13 /
  add_lora_w2 signatures, w13's returned metadata feeding w2), fed by vLLM's own
  ``update_metadata`` (the masks come from the base's ``token_lora_indices`` / ``sampler_indices``);
* production-style metadata (slot table with holes, ids unrelated to slots, ``max_loras`` = slots + 1)
  routes every row to the right slot;
* ``apply_lora_full_linear`` (vLLM ≥ 0.32) matches vLLM's CPU wrapper.
"""

from __future__ import annotations

import pytest
import torch
from profile_runs import run_profile

pytest.importorskip("vllm.lora.punica_wrapper.punica_base", reason="needs vLLM (pip install 'lora-conformance[vllm]')")

from conformance.generator import profile_cases
from conformance.reference import LoRAMapping, PunicaWrapperReference
from conformance.targets._vllm import import_vllm_module, vllm_version
from conformance.targets.base import WRAPPER_OPS
from conformance.targets.hpu.vllm_wrapper import make_vllm_punica_wrapper_class
from conformance.targets.vllm034_layers import VLLM_034_LAYERS
from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget, vllm_release
from conformance.verdict import Outcome

PunicaWrapperBase = import_vllm_module("vllm.lora.punica_wrapper.punica_base", "test").PunicaWrapperBase


class VllmSubclassTarget(VllmPunicaWrapperTarget):
    """The vLLM subclass driven exactly like the ``cpu`` target drives vLLM's PunicaWrapperCPU."""

    name = "hpu-vllm-subclass"

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                     expert_map=None, offset=0, add_inputs=True):
        """The suite's neutral w13, called in vLLM's signature (offset: vLLM's w13 has none)."""
        if offset:
            raise NotImplementedError("vLLM's add_lora_w13 has no offset")
        T, k = topk_ids.shape
        shapes = torch.empty(0)  # w1, w2: read for Triton tile configs only
        self.wrapper.add_lora_w13(y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, shapes, shapes, T, k,
                                  lora_a_stacked[0].size(0), adapter_enabled, lora_b_stacked[0].size(1), k, len(lora_a_stacked),
                                  False, False, add_inputs=add_inputs)

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                    expert_map=None, offset=0, add_inputs=True):
        """The suite's neutral w2 through vLLM's pair of calls: w13's returned metadata feeds w2."""
        T, k = topk_ids.shape
        width = lora_b_stacked[0].size(-2)
        if offset % width:
            raise NotImplementedError(f"vLLM's add_lora_w2 places a shard at shard_size · tp_rank; offset {offset} is none")
        shapes = torch.empty(0)
        local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
        self.wrapper.add_lora_w2(y, x, lora_a_stacked, lora_b_stacked, topk_weights, None, local.reshape(-1).int(), None, None, T,
                                 shapes, shapes, k, lora_a_stacked[0].size(0), adapter_enabled, k, offset > 0, offset // width,
                                 False, add_inputs=add_inputs)


def vllm_subclass_target(variant: str, moe_variant: str = "grouped") -> VllmSubclassTarget:
    """The target over the class of ``variant`` and ``moe_variant`` (a class attribute: check_available reads it there)."""
    wrapper_class = make_vllm_punica_wrapper_class(variant, moe_variant=moe_variant)
    return type(f"VllmSubclassTarget[{variant}, {moe_variant}]", (VllmSubclassTarget,), {"wrapper_class": wrapper_class})()


def test_the_class_is_a_vllm_punica_wrapper():
    cls = make_vllm_punica_wrapper_class()
    assert issubclass(cls, PunicaWrapperBase)
    wrapper = cls(64, 8, "cpu")
    assert isinstance(wrapper, PunicaWrapperBase)
    assert make_vllm_punica_wrapper_class() is cls  # built once


@pytest.mark.slow  # every wrapper smoke case
@pytest.mark.parametrize(("variant", "moe_variant"), [("mask", "grouped"), ("gather", "gather"), ("mask", "mask")])
def test_smoke_wrapper_cases_pass_through_the_vllm_subclass(variant, moe_variant):
    target = vllm_subclass_target(variant, moe_variant)
    assert target.supports_bias()
    # vLLM's MoE signatures place a shard's columns only at shard_size · tp_rank (w2) or nowhere (w13)
    cases = [(i, c) for i, c in profile_cases("smoke", ops=WRAPPER_OPS) if not (c.is_moe and c.offset_start)]
    outcomes, failures = run_profile(target, cases)
    # vLLM 0.34's layer ops run the layer's code, which an older vLLM does not have: not supported, saying so
    predates = f"not supported: the installed vLLM {vllm_version()} predates "
    if vllm_release() < (0, 34):
        layer_cases = [failure for failure in failures if failure.split(":")[1] in VLLM_034_LAYERS]
        assert layer_cases and all(predates in failure for failure in layer_cases), layer_cases[:3]
        assert len(layer_cases) == sum(c.op in VLLM_034_LAYERS for _, c in cases)
        failures = [failure for failure in failures if failure not in layer_cases]
    assert not failures, failures[:10]
    assert sum(c.is_moe for _, c in cases) > 50
    assert outcomes[Outcome.PASS] > 100


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_production_style_metadata_routes_rows_to_their_slots():
    """Slots 1 and 3 of 4 hold adapters with ids 7 and 3; id 0 means no adapter."""
    layers = import_vllm_module("vllm.lora.layers", "test")
    table = [None, 7, None, 3]
    ids = (7, 7, 0, 3, 3, 3, 0, 7)
    sampled_ids = (7, 0, 3)
    slots = tuple({0: -1, 7: 1, 3: 3}[i] for i in ids)
    sampled_slots = tuple({0: -1, 7: 1, 3: 3}[i] for i in sampled_ids)
    gen = torch.Generator().manual_seed(0)
    L, R, H, slices = 4, 8, 32, (24, 8, 8)
    a = tuple(torch.randn(L, 1, R, H, generator=gen, dtype=torch.float64).to(torch.bfloat16) for _ in slices)
    b = tuple(torch.randn(L, 1, n, R, generator=gen, dtype=torch.float64).to(torch.bfloat16) for n in slices)
    x = torch.randn(len(ids), H, generator=gen).to(torch.bfloat16)
    y = torch.randn(len(ids), sum(slices), generator=gen).to(torch.bfloat16)
    h = torch.randn(len(sampled_ids), H, generator=gen).to(torch.bfloat16)
    logits = torch.randn(len(sampled_ids), 24, generator=gen).to(torch.bfloat16)

    wrapper = make_vllm_punica_wrapper_class()(64, 8, "cpu")
    wrapper.update_metadata(layers.LoRAMapping(ids, sampled_ids, is_prefill=True), table, len(table) + 1, 1000)
    reference = PunicaWrapperReference()
    reference.update_metadata(LoRAMapping(slots, sampled_slots, (3, 3, 2), True, L))
    outputs = []
    for impl in (wrapper, reference):
        y_out, logits_out = y.clone(), logits.clone()
        impl.add_lora_linear(y_out, x, a, b, 0.5, slices)
        impl.add_lora_logits(logits_out, h, a[0], b[0], 0.5)
        outputs.append((y_out, logits_out))
    (y_hpu, logits_hpu), (y_ref, logits_ref) = outputs
    torch.testing.assert_close(y_hpu, y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits_hpu, logits_ref, rtol=2e-2, atol=2e-2)
    no_adapter = torch.tensor(slots) == -1
    assert torch.equal(y_hpu[no_adapter], y[no_adapter])
    assert not torch.equal(y_hpu[~no_adapter], y[~no_adapter])


@pytest.mark.integration  # starts a process: not the in-process unit loop
@pytest.mark.skipif(not hasattr(PunicaWrapperBase, "_select_full_linear_output"), reason="vLLM without full-linear LoRA")
def test_apply_lora_full_linear_matches_vllms_cpu_wrapper():
    layers = import_vllm_module("vllm.lora.layers", "test")
    cpu_class = import_vllm_module("vllm.lora.punica_wrapper.punica_cpu", "test").PunicaWrapperCPU
    gen = torch.Generator().manual_seed(1)
    L, N, H = 3, 16, 24
    weight = torch.randn(L, 1, N, H, generator=gen)
    bias = torch.randn(L, N, generator=gen)
    enabled = torch.tensor([True, False, True])
    x, y = torch.randn(4, H, generator=gen), torch.randn(4, N, generator=gen)
    mapping = layers.LoRAMapping((1, 2, 0, 3), (1, 2, 0, 3), is_prefill=False)
    results = []
    for cls in (make_vllm_punica_wrapper_class(), cpu_class):
        wrapper = cls(16, 4, "cpu")
        wrapper.update_metadata(mapping, [1, 2, 3], L + 1, 1000)
        out = y.clone()
        wrapper.apply_lora_full_linear(out, x, weight, bias, enabled)
        results.append(out)
    torch.testing.assert_close(results[0], results[1])
    assert torch.equal(results[0][1:3], y[1:3])  # slot 1 disabled, row 2 without adapter: base output kept
