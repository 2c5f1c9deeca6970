"""Correct ways to compute ``fused_moe_lora_fp8`` never fail a case: no false alarm over 1,000 value seeds.

As ``test_fp8_calibration`` does for the dense fp8 ops, with three correct targets that compute the MoE op
differently: the reference in float32 (``ReferenceTarget``: dequantize in float32, one product per (slot,
expert), vLLM's two roundings), the mask-based ``PlainTorchTarget`` (dequantize in float32, every (slot,
expert)'s product then a mask) and ``hpu-emulated`` (dequantize in float32, the grouped engine, the
intermediate kept in float32). The structures are the op's smoke cases of run seeds 0–4 (45: every
granularity and dtype, with and without the routing weight); value seed ``i`` fills structure ``i mod 45``.
No result may fail, and none may come past ``HEADROOM`` of its budget or of the systematic-error threshold.
With one torch thread (tests/conftest.py): about 30 s for the reference and the plain target, 2 minutes for
``hpu-emulated``.
"""

from __future__ import annotations

import pytest
from fault_targets import PlainTorchTarget
from test_fp8_calibration import HEADROOM, structures, sweep

from conformance.targets.hpu import HpuEmulatedTarget
from conformance.targets.reference import ReferenceTarget

OPS = ("fused_moe_lora_fp8",)


def test_the_structures_cover_every_granularity_dtype_and_routing_weight():
    cases = [case for _, case in structures(OPS)]
    assert len(cases) == 45
    assert {case.fp8_scales for case in cases} == {"tensor", "channel", "block"}
    assert {case.dtype for case in cases} == {"float16", "bfloat16", "float32"}
    assert {case.routed_weight for case in cases} == {True, False}


@pytest.mark.slow
@pytest.mark.parametrize("target", [ReferenceTarget, PlainTorchTarget, HpuEmulatedTarget], ids=lambda t: t.name)
def test_a_correct_target_passes_every_moe_fp8_seed_with_headroom(target):
    failed, budget, systematic = sweep(target(), OPS)
    assert failed == []
    assert budget <= HEADROOM and systematic <= HEADROOM, f"budget ratio {budget:.3g}, systematic ratio {systematic:.3g}"
