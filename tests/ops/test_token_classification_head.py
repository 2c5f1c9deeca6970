"""``token_classification_head``: vLLM 0.33's token classification head as one op (docs/targets.md).

The head is ``add_shrink`` of the whole per-adapter head ``[L, 1, P, H]`` into a float32 ``[1, T, P]``
buffer, then the layer's pick over the tokens' slots. These tests hold its oracle to the formula row by
row, its composition over a target's own ``add_shrink`` to the oracle, its cases to the corners they are
drawn for (label counts no multiple of 16 and above 256, tokens with and without a head and without
adapter) within their budget, show what the pick hides of vLLM 0.32's CPU ``add_shrink``, and hold the
HPU implementation to one set of compiled graphs whatever the label count or the adapter mix.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from fault_targets import HeadReplacesNoAdapterRows, PlainTorchClassicTarget, PlainTorchTarget
from packaging.version import Version

from conformance.cases.features import case_features
from conformance.generator.families import FAMILIES, families_for
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.reference import LoRAMapping, PunicaWrapperReference
from conformance.targets.base import TargetUnavailable

OP = "token_classification_head"
# tokens: two of slot 0 (a saved head), two without adapter, one of slot 1 (no saved head), one of slot 2 (a head)
MAPPING = LoRAMapping(token_slots=(0, 0, -1, -1, 1, 2), sampled_slots=(0, -1, 1, 2), seq_lens=(2, 2, 1, 1),
                      is_prefill=True, num_slots=3)
ENABLED = torch.tensor([True, False, True])


def _tensors(labels: int, hidden: int = 8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(labels)
    x = torch.randn(6, hidden, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(3, 1, labels, hidden, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(3, labels, generator=gen, dtype=torch.float64).to(dtype)
    base = torch.randn(6, labels, generator=gen, dtype=torch.float64).to(dtype)
    return x, weight, bias, base


def _reference(x, weight, bias, base) -> torch.Tensor:
    wrapper = PunicaWrapperReference()
    wrapper.update_metadata(MAPPING)
    y = base.clone()
    wrapper.token_classification_head(y, x, weight, bias, ENABLED)
    return y


# -- the oracle --------------------------------------------------------------------------------


@pytest.mark.parametrize("labels", [2, 9, 17, 300])
def test_the_oracle_replaces_tokens_with_a_head_and_keeps_every_other_row(labels):
    x, weight, bias, base = _tensors(labels)
    y = _reference(x, weight, bias, base)
    for row, slot in enumerate(MAPPING.token_slots):
        if slot >= 0 and ENABLED[slot]:
            expected = sum(x[row, h] * weight[slot, 0, :, h] for h in range(x.size(1))) + bias[slot]
            torch.testing.assert_close(y[row], expected, rtol=1e-12, atol=1e-12)
        else:  # no adapter, or an adapter without a saved head: the base output, bit for bit
            assert torch.equal(y[row], base[row]), (row, slot)


def test_the_oracle_rounds_once_from_float32_in_a_16_bit_dtype():
    x, weight, bias, base = _tensors(9, hidden=64, dtype=torch.bfloat16)
    y = _reference(x, weight, bias, base)
    served = [row for row, slot in enumerate(MAPPING.token_slots) if slot >= 0 and ENABLED[slot]]
    slots = torch.tensor([MAPPING.token_slots[row] for row in served])
    product = torch.einsum("rh,rph->rp", x[served].float(), weight[slots, 0].float()) + bias[slots].float()
    assert torch.equal(y[served], product.to(torch.bfloat16))


def test_the_oracle_refuses_a_head_whose_width_is_not_the_outputs():
    x, weight, bias, base = _tensors(9)
    with pytest.raises(ValueError, match="does not fit"):
        _reference(x, weight[:, :, :8], bias[:, :8], base)


# -- the composition over a target's add_shrink --------------------------------------------------


@pytest.mark.parametrize("target_class", [PlainTorchTarget, PlainTorchClassicTarget])
@pytest.mark.parametrize("labels", [3, 17, 1000])
def test_the_composition_over_add_shrink_matches_the_oracle(target_class, labels):
    x, weight, bias, base = _tensors(labels, dtype=torch.float32)
    target = target_class()
    target.update_metadata(MAPPING)
    y = base.clone()
    target.token_classification_head(y, x, weight, bias, ENABLED)
    expected = _reference(*(t.double() for t in (x, weight, bias, base)))
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    kept = [row for row, slot in enumerate(MAPPING.token_slots) if slot < 0 or not ENABLED[slot]]
    assert torch.equal(y[kept], base[kept])


def test_a_pick_that_reads_the_last_slot_for_no_adapter_rows_is_seen():
    x, weight, bias, base = _tensors(9, dtype=torch.float32)
    target = HeadReplacesNoAdapterRows()
    target.update_metadata(MAPPING)
    y = base.clone()
    target.token_classification_head(y, x, weight, bias, ENABLED)
    assert not torch.equal(y[2:4], base[2:4])  # slot 2, the last, has a head: its bias lands on the −1 rows


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_vllm_032s_cpu_add_shrink_writes_no_adapter_rows_and_the_pick_hides_it():
    """vLLM below 0.33 gives slot −1 rows the last slot's product in ``add_shrink`` (docs/vllm-lora-ops.md §2.3);
    the head's pick drops those rows, so the ``cpu`` target passes every head case."""
    from conformance.targets.vllm_cpu import VllmCpuTarget

    try:
        target = VllmCpuTarget()
    except TargetUnavailable as exc:
        pytest.skip(str(exc))
    x, weight, bias, base = _tensors(9, dtype=torch.float32)
    target.update_metadata(MAPPING)
    buffer = torch.zeros(1, 6, 9)
    target.add_shrink(buffer, x, (weight,), 1.0)
    leaked = not torch.equal(buffer[0, 2:4], torch.zeros(2, 9))
    assert leaked == (Version(target.package_versions.get("vllm", _installed_vllm())) < Version("0.33")), buffer[0, 2:4]
    y = base.clone()
    target.token_classification_head(y, x, weight, bias, ENABLED)
    assert torch.equal(y[2:4], base[2:4])


def _installed_vllm() -> str:
    from conformance.targets._vllm import installed_vllm_version

    return installed_vllm_version()


# -- the cases ---------------------------------------------------------------------------------


def test_only_the_named_families_draw_the_head_and_the_head_families_draw_nothing_else():
    spec = OP_SPECS[OP]
    assert {f.name for f in families_for(spec, "float16")} == set(spec.families)
    own = {"token_classification", "cls_labels_wide"}
    assert all(FAMILIES[name].named_only for name in own)
    for name, other in OP_SPECS.items():
        if name != OP:
            for dtype in ("float16", "bfloat16", "float32"):
                assert not own & {f.name for f in families_for(other, dtype)}, name


def test_the_smoke_and_standard_profiles_hold_few_head_cases_each_in_its_corner():
    smoke = profile_cases("smoke", ops=(OP,))
    standard = profile_cases("standard", ops=(OP,))
    assert 0 < len(smoke) <= 20 and len(standard) <= 100
    widths = Counter()
    for _, case in standard:
        features = case_features(case)
        if case.family == "token_classification":
            assert "token_classification" in features and case.output_width % 16, case
        widths["odd"] += case.output_width % 16 != 0
        if case.family == "cls_labels_wide":
            assert case.output_width > 256 and "cls_labels_wide" in features, case
        assert case.output_slices == (case.output_width,) and case.is_prefill
    assert widths["odd"] >= 20
    assert any(case.output_width in (2, 3, 9, 17) for _, case in standard)


# -- the HPU implementation: any label count, no graph per label count or per adapter mix ---------------

# One bucket (5–8 tokens → 8), different adapter mixes and saved heads.
SAME_BUCKET = (
    ([0, 1, 0, 2, -1, 0, 1, 1], [True, False, True]),
    ([-1] * 5, [True, True, True]),
    ([2, 2, 2, 1, 1, 1], [False, False, True]),
    ([0, -1, 1, -1, 0, -1, 2], [True, True, False]),
)


def _hpu_head_graphs(labels: int) -> tuple[int, int]:
    """(graphs after the first call, after every call of ``SAME_BUCKET``) of the head on the emulated HPU
    engine compiled with ``dynamic=False``, at ``labels`` labels."""
    from graph_counting import CountingBackend

    from conformance.targets.hpu import BucketPolicy, HpuPunicaWrapper, LoRAEngine
    from conformance.targets.hpu.device import CpuDeviceLayer

    backend = CountingBackend()
    wrapper = HpuPunicaWrapper(LoRAEngine("mask", BucketPolicy(), CpuDeviceLayer(compile_backend=backend)))
    gen = torch.Generator().manual_seed(labels)
    weight = torch.randn(3, 1, labels, 16, generator=gen).to(torch.bfloat16)
    bias = torch.randn(3, labels, generator=gen).to(torch.bfloat16)
    counts = []
    for slots, enabled in (SAME_BUCKET[0], *SAME_BUCKET):
        wrapper.set_slots(torch.tensor(slots), torch.tensor(slots[:1]))
        x = torch.randn(len(slots), 16, generator=gen).to(torch.bfloat16)
        base = torch.randn(len(slots), labels, generator=gen).to(torch.bfloat16)
        y = base.clone()
        wrapper.token_classification_head(y, x, weight, bias, torch.tensor(enabled))
        kept = [t for t, slot in enumerate(slots) if slot < 0 or not enabled[slot]]
        assert torch.equal(y[kept], base[kept])
        counts.append(backend.graphs)
    return counts[0], counts[-1]


def test_the_hpu_head_compiles_the_graphs_of_16_labels_for_9_or_1000_and_none_per_adapter_mix():
    """The head's width is a static dimension like a rank (no bucket, no padding); the slots and the saved
    heads are data: one set of graphs per bucket, whatever the mix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets" / "hpu"))  # the HPU tests' graph counter
    from graph_counting import fresh_dynamo

    with fresh_dynamo():
        warm, after = _hpu_head_graphs(16)
        assert warm > 0 and after == warm
        for labels in (9, 1000):
            torch._dynamo.reset()
            assert _hpu_head_graphs(labels) == (warm, warm), labels
