"""What the HPU LoRA math must keep apart: rows without adapter, unused slots, and the two variants.

* Rows of slot −1 (and columns outside the written slice) come back **bit-identical**, also when they
  hold NaN, ±Inf or −0.0 and also with ``add_inputs=False``, for every wrapper method and kernel op
  (``y + 0`` would turn −0.0 into +0.0; the writes select with ``torch.where``).
* A NaN or Inf planted in an **unused** slot's LoRA-A, LoRA-B or bias reaches no output: the results
  are bit-identical to those with finite weights there. Gaudi's multiply-by-mask form
  (``((x @ A_flat.T) * M) @ B_flat``) *does* leak NaN into every row (``0 · Inf = NaN``); the test
  shows that on the same data, so the isolation check is known to be able to fail.
* The mask-based and the gather-based variants agree on every smoke case of every op.
"""

from __future__ import annotations

import pytest
import torch

from conformance.generator import profile_cases
from conformance.ops import OP_SPECS
from conformance.reference import LoRAMapping, PunicaWrapperReference
from conformance.runner import execute, make_values
from conformance.targets.hpu import BucketPolicy, HpuEmulatedGatherTarget, HpuEmulatedTarget, HpuPunicaWrapper, LoRAEngine
from conformance.targets.hpu.stacks import flat_a, flat_b
from conformance.targets.reference import ReferenceTarget
from conformance.verdict.metrics import compare_values
from conformance.verdict.tolerances import tolerance_for

L, R, H = 4, 8, 24
SLICES = (16, 8)
UNUSED = 2  # no row of the batches below uses slot 2
TOKEN_SLOTS = [0, -1, 3, 3, -1, 1, 0, -1, 1]
SAMPLED_SLOTS = [0, -1, 3, 1]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _mapping() -> LoRAMapping:
    return LoRAMapping(tuple(TOKEN_SLOTS), tuple(SAMPLED_SLOTS), (len(TOKEN_SLOTS),), True, L)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so that NaN == NaN and −0.0 != +0.0."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def planted(shape, dtype, gen) -> torch.Tensor:
    """Random values with NaN, ±Inf and −0.0 in the first columns of every row."""
    t = torch.randn(*shape, generator=gen).to(dtype)
    t[..., 0], t[..., 1], t[..., 2], t[..., 3] = float("nan"), float("inf"), float("-inf"), -0.0
    return t


def stacks(dtype, gen, poison: float | None = None) -> dict:
    """LoRA stacks for ``SLICES``; with ``poison``, slot ``UNUSED`` is filled with it everywhere."""
    w = {
        "a": [torch.randn(L, 1, R, H, generator=gen).to(dtype) / H**0.5 for _ in SLICES],
        "b": [torch.randn(L, 1, n, R, generator=gen).to(dtype) / R**0.5 for n in SLICES],
        "bias": [torch.randn(L, 1, n, generator=gen).to(dtype) for n in SLICES],
        "emb_b": torch.randn(L, 1, 12, R, generator=gen).to(dtype),
        "logits_a": torch.randn(L, 1, R, H, generator=gen).to(dtype),
        "logits_b": torch.randn(L, 1, 20, R, generator=gen).to(dtype),
    }
    if poison is not None:
        for tensor in [*w["a"], *w["b"], *w["bias"], w["emb_b"], w["logits_a"], w["logits_b"]]:
            tensor[UNUSED] = poison
    w = {k: tuple(v) if isinstance(v, list) else v for k, v in w.items()}
    return w


def run_all(wrapper, w: dict, dtype, gen, y_maker=planted) -> dict[str, torch.Tensor]:
    """Every wrapper method on one batch (outputs planted with NaN/±Inf/−0.0 by default)."""
    T, P = len(TOKEN_SLOTS), len(SAMPLED_SLOTS)
    wrapper.update_metadata(_mapping())
    x = torch.randn(T, H, generator=gen).to(dtype)
    s = torch.randn(len(SLICES), T, R, generator=gen)
    out = {
        "linear": y_maker((T, sum(SLICES)), dtype, gen),
        "expand_add": y_maker((T, 3 + sum(SLICES) + 2), dtype, gen),
        "expand_overwrite": y_maker((T, 3 + sum(SLICES) + 2), dtype, gen),
        "shrink": torch.zeros(len(SLICES), T, R),
        "embedding": y_maker((T, 12), dtype, gen),
        "embedding_overwrite": y_maker((T, 12), dtype, gen),
        "logits": y_maker((P, 20), dtype, gen),
    }
    wrapper.add_lora_linear(out["linear"], x, w["a"], w["b"], 0.5, SLICES, lora_bias_stacked=w["bias"])
    wrapper.add_expand(out["expand_add"], s, w["b"], SLICES, 3, True, lora_bias_stacked=w["bias"])
    wrapper.add_expand(out["expand_overwrite"], s, w["b"], SLICES, 3, False)
    wrapper.add_shrink(out["shrink"], x, w["a"], 0.5)
    e = torch.randn(T, R, generator=gen).to(dtype)
    wrapper.add_lora_embedding(out["embedding"], e, w["emb_b"], True)
    wrapper.add_lora_embedding(out["embedding_overwrite"], e, w["emb_b"], False)
    wrapper.add_lora_logits(out["logits"], torch.randn(P, H, generator=gen).to(dtype), w["logits_a"], w["logits_b"], 0.5)
    return out


def wrapper_for(variant: str) -> HpuPunicaWrapper:
    return HpuPunicaWrapper(LoRAEngine(variant, BucketPolicy()))


@pytest.mark.parametrize("variant", ["mask", "gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_without_adapter_and_other_columns_are_bit_identical(variant, dtype):
    w = stacks(dtype, torch.Generator().manual_seed(0))
    before = run_all(_Untouched(), w, dtype, torch.Generator().manual_seed(1))  # the initial outputs, untouched
    after = run_all(wrapper_for(variant), w, dtype, torch.Generator().manual_seed(1))
    token_rows = torch.tensor(TOKEN_SLOTS) == -1
    sampled_rows = torch.tensor(SAMPLED_SLOTS) == -1
    for name in after:
        rows = sampled_rows if name == "logits" else token_rows
        if name == "shrink":
            assert torch.equal(after[name][:, rows], before[name][:, rows])
            continue
        assert torch.equal(bits(after[name])[rows], bits(before[name])[rows]), name
    for name in ("expand_add", "expand_overwrite"):  # columns before offset_start and after the slices
        for columns in (slice(0, 3), slice(3 + sum(SLICES), None)):
            assert torch.equal(bits(after[name])[:, columns], bits(before[name])[:, columns]), name


# Ops whose code is a vLLM layer's that adds a whole delta buffer to the output, zero in the rows without adapter
# (DeepseekV4CompressorKVScoreWithLoRA: y += delta): their untouched rows keep their values, not a -0.0's sign bit.
ADDS_A_ZERO_DELTA = {"fp32_output_lora_linear"}


@pytest.mark.slow  # every smoke case
@pytest.mark.parametrize("target_class", [HpuEmulatedTarget, HpuEmulatedGatherTarget])
def test_every_op_leaves_what_it_must_not_write_bit_identical(target_class):
    """All smoke cases of every op (kernel and wrapper level), with NaN/±Inf/−0.0 planted wherever the
    op must not write (rows of slot −1, columns outside the slices): those elements come back bit for bit."""
    target = target_class()
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    for case_id, case in profile_cases("smoke"):
        spec, values = OP_SPECS[case.op], make_values(case)
        written = spec.written_mask(case)
        if written.all():
            continue
        initial = values[spec.output]
        fill = specials.to(initial.dtype)[torch.arange(initial.numel()) % 4].reshape(initial.shape)
        initial = torch.where(written, initial, fill)
        got = execute(spec, case, {**values, spec.output: initial}, target, target.device)[spec.output]
        if case.op in ADDS_A_ZERO_DELTA:
            # by value: -0.0 + 0.0 is +0.0, which the verdict counts as no change (compare_values)
            assert not compare_values(got, initial).changed[~written].any(), case_id
            continue
        assert torch.equal(bits(got)[~written], bits(initial)[~written]), case_id


class _Untouched:
    """A stand-in wrapper that changes nothing: ``run_all`` through it yields the initial outputs."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("variant", ["mask", "gather"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_or_inf_in_an_unused_slot_does_not_leak(variant, poison, dtype):
    def finite(shape, dtype, gen):
        return torch.randn(*shape, generator=gen).to(dtype)

    clean_weights = stacks(dtype, torch.Generator().manual_seed(0))
    clean = run_all(wrapper_for(variant), clean_weights, dtype, torch.Generator().manual_seed(1), finite)
    poisoned_weights = stacks(dtype, torch.Generator().manual_seed(0), poison)
    poisoned = run_all(wrapper_for(variant), poisoned_weights, dtype, torch.Generator().manual_seed(1), finite)
    for name in clean:
        assert torch.isfinite(poisoned[name]).all(), f"{name}: a non-finite value of unused slot {UNUSED} leaked"
        assert torch.equal(poisoned[name], clean[name]), name

    # And the results are the reference's (slot UNUSED is never read by it either).
    reference = PunicaWrapperReference()
    reference.update_metadata(_mapping())
    expected = run_all(reference, poisoned_weights, dtype, torch.Generator().manual_seed(1), finite)
    for name in clean:
        torch.testing.assert_close(poisoned[name], expected[name], rtol=2e-2, atol=2e-2)


def test_multiplying_by_the_mask_would_leak():
    """Gaudi's ``dispatch_bgmv_linear`` form on the same poisoned data: every row becomes NaN."""
    dtype = torch.float32
    w = stacks(dtype, torch.Generator().manual_seed(0), float("inf"))
    x = torch.randn(len(TOKEN_SLOTS), H, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor(TOKEN_SLOTS)
    mask = ((torch.arange(L * R) // R)[None, :] == slots[:, None]).to(dtype)
    naive = ((x @ flat_a(w["a"][0]).T) * mask) @ flat_b(w["b"][0])
    rows_with_adapter = slots != -1
    assert torch.isnan(naive[rows_with_adapter]).all(dim=1).all(), "0 · Inf should poison every adapter row"
    assert torch.isnan(naive).any(dim=1).all(), "… and, added to y, every row, rows without adapter included"

    y = torch.zeros(len(TOKEN_SLOTS), SLICES[0])
    wrapper = wrapper_for("mask")
    wrapper.set_slots(slots, slots)
    wrapper.add_lora_linear(y, x, w["a"][:1], w["b"][:1], 1.0, SLICES[:1])
    assert torch.isfinite(y).all()


# -- the two variants agree --------------------------------------------------------------------


@pytest.fixture(scope="module")
def variants():
    return HpuEmulatedTarget(), HpuEmulatedGatherTarget()


@pytest.mark.slow  # every smoke case, on both variants and the reference
@pytest.mark.parametrize("op", sorted(OP_SPECS))
def test_mask_and_gather_variants_agree(variants, op):
    """Outside the written region both leave the output alone (bit for bit); inside, they differ by less
    than 1.5 of the suite's error budgets (``k`` × the case-dtype reference's error + floor).

    Each variant passing the suite only guarantees 2 budgets (triangle inequality); the variants share
    every rounding point, so only float32 summation order separates them (measured on the smoke
    profile: ≤ 0.8 budget, and bit-identical in most low-precision cases).
    """
    mask_target, gather_target = variants
    reference, cpu = ReferenceTarget(), torch.device("cpu")
    for case_id, case in profile_cases("smoke", ops=(op,)):
        spec, values = OP_SPECS[op], make_values(case)
        a = execute(spec, case, values, mask_target, mask_target.device)[spec.output]
        b = execute(spec, case, values, gather_target, gather_target.device)[spec.output]
        if spec.check is not None:  # integer metadata (moe_lora_align_block_size): one implementation, equal
            assert torch.equal(a, b), case_id
            continue
        written = spec.written_mask(case)
        assert torch.equal(bits(a)[~written], bits(b)[~written]), case_id
        if not written.any():
            continue
        oracle = execute(spec, case, {k: v.double() if v.is_floating_point() else v for k, v in values.items()}, reference, cpu)[spec.output]
        baseline = execute(spec, case, values, reference, cpu)[spec.output]
        tolerance = tolerance_for(a.dtype)
        scale = max(float(oracle[written].abs().max()), 1e-30)
        budget = tolerance.k * float((baseline.double() - oracle)[written].abs().max())
        budget += tolerance.floor_ulps * torch.finfo(a.dtype).eps * scale
        difference = float((a.double() - b.double())[written].abs().max())
        assert difference <= 1.5 * budget, f"{case_id}: the variants differ by {difference:.3g}, budget {budget:.3g}"
