"""Static shapes of the HPU LoRA implementation: what lets Gaudi compile once per bucket.

* Under ``torch.compile(dynamic=False)`` (on the CPU, with a backend that only counts graphs), batches
  of one bucket with different adapter mixes — different active slots, all rows without adapter,
  different row counts inside the bucket, different sampled rows — cause **zero** recompilations of
  any core function, for every wrapper method. Two controls show the counter can move: a new bucket
  compiles new graphs, and without bucketing every row count does.
* The padded run equals the unpadded run on the valid rows (up to GEMM summation order), and rows
  without adapter come back bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from graph_counting import CountingBackend, fresh_dynamo

from conformance.targets.hpu import BucketPolicy, HpuPunicaWrapper, LoRAEngine
from conformance.targets.hpu.device import CpuDeviceLayer

L, R, H = 4, 8, 32
SLICES = (32, 16)  # unequal packed slices (GQA-like)
D = V = 32  # embedding width, logits vocabulary
SCALE = 0.5
DTYPE = torch.bfloat16


def weights(gen: torch.Generator) -> dict:
    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(DTYPE)

    return {
        "a": tuple(rand(L, 1, R, H, fan_in=H) for _ in SLICES),
        "b": tuple(rand(L, 1, n, R, fan_in=R) for n in SLICES),
        "bias": tuple(rand(L, 1, n, fan_in=1) for n in SLICES),
        "emb_b": rand(L, 1, D, R, fan_in=R),
        "logits_a": rand(L, 1, R, H, fan_in=H),
        "logits_b": rand(L, 1, V, R, fan_in=R),
    }


def run_batch(wrapper: HpuPunicaWrapper, w: dict, token_slots: list[int], sampled_slots: list[int], gen: torch.Generator) -> dict:
    """Every wrapper method once on one batch; returns the outputs."""
    T, P = len(token_slots), len(sampled_slots)
    wrapper.set_slots(torch.tensor(token_slots), torch.tensor(sampled_slots))
    x = torch.randn(T, H, generator=gen).to(DTYPE)
    out = {
        "linear": torch.randn(T, sum(SLICES), generator=gen).to(DTYPE),
        "shrink": torch.zeros(len(SLICES), T, R),
        "expand": torch.randn(T, 8 + sum(SLICES), generator=gen).to(DTYPE),
        "embedding": torch.randn(T, D, generator=gen).to(DTYPE),
        "logits": torch.randn(P, V, generator=gen).to(DTYPE),
    }
    wrapper.add_lora_linear(out["linear"], x, w["a"], w["b"], SCALE, SLICES, lora_bias_stacked=w["bias"])
    wrapper.add_shrink(out["shrink"], x, w["a"], SCALE)
    wrapper.add_expand(out["expand"], out["shrink"], w["b"], SLICES, offset_start=8, add_inputs=False)
    wrapper.add_lora_embedding(out["embedding"], torch.randn(T, R, generator=gen).to(DTYPE), w["emb_b"])
    wrapper.add_lora_logits(out["logits"], torch.randn(P, H, generator=gen).to(DTYPE), w["logits_a"], w["logits_b"], SCALE)
    return out


# Batches of one bucket (5–8 tokens → 8, 3–4 sampled rows → 4) with different adapter mixes and row counts.
SAME_BUCKET = [
    ([0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 2, 3]),
    ([-1, -1, -1, -1, -1], [-1, -1, -1]),  # no adapter at all, fewer rows (5 of 8, 3 of 4)
    ([3, -1, 3, -1, 3, -1, 3], [3, -1, 3]),  # one adapter on non-adjacent rows
    ([1] * 8, [1, 1, 1, 1]),
    ([2, 0, -1, 3, 1, 2], [2, 0, -1]),
]


@pytest.fixture(autouse=True)
def dynamo_reset():
    with fresh_dynamo():
        yield


@pytest.mark.parametrize("variant", ["mask", "gather"])
def test_adapter_mix_changes_within_a_bucket_never_recompile(variant):
    backend = CountingBackend()
    compiled = HpuPunicaWrapper(LoRAEngine(variant, BucketPolicy(), CpuDeviceLayer(compile_backend=backend)))
    eager = HpuPunicaWrapper(LoRAEngine(variant, BucketPolicy()))
    w = weights(torch.Generator().manual_seed(0))

    run_batch(compiled, w, *SAME_BUCKET[0], torch.Generator().manual_seed(1))  # warm-up: compiles each core function
    graphs_after_warm_up = backend.graphs
    assert graphs_after_warm_up > 0
    assert compiled.engine.stacks.hits > 0  # flattened weights were prepared once and reused

    for i, (tokens, sampled) in enumerate(SAME_BUCKET):
        got = run_batch(compiled, w, tokens, sampled, torch.Generator().manual_seed(10 + i))
        want = run_batch(eager, w, tokens, sampled, torch.Generator().manual_seed(10 + i))
        for name in got:  # the compiled graphs compute what the eager code computes
            assert torch.equal(got[name], want[name]), name
    assert backend.graphs == graphs_after_warm_up, "a batch of the same bucket recompiled a core function"

    # Control: a batch of another bucket (16 tokens, 8 sampled rows) does compile new graphs.
    run_batch(compiled, w, [0, 1] * 6, [0, 1, 2, 3, 0, 1], torch.Generator().manual_seed(99))
    assert backend.graphs > graphs_after_warm_up


def test_without_buckets_every_row_count_recompiles():
    """The negative control: what bucketing saves (and proof that the counter sees recompiles)."""
    backend = CountingBackend()
    wrapper = HpuPunicaWrapper(LoRAEngine("mask", BucketPolicy.none(), CpuDeviceLayer(compile_backend=backend)))
    w = weights(torch.Generator().manual_seed(0))
    counts = []
    for tokens in ([0, 1, 2, 3, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1, 2]):
        wrapper.set_slots(torch.tensor(tokens), torch.tensor(tokens[:2]))
        x = torch.randn(len(tokens), H).to(DTYPE)
        wrapper.add_lora_linear(torch.zeros(len(tokens), sum(SLICES), dtype=DTYPE), x, w["a"], w["b"], SCALE, SLICES)
        counts.append(backend.graphs)
    assert counts[0] < counts[1] < counts[2]


@pytest.mark.parametrize("variant", ["mask", "gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 13, 100])
def test_padded_bucket_equals_unpadded_on_valid_rows(variant, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randint(-1, L, (tokens,), generator=gen)
    a = tuple((torch.randn(L, R, H, generator=gen) / H**0.5).to(dtype) for _ in SLICES)
    b = tuple((torch.randn(L, n, R, generator=gen) / R**0.5).to(dtype) for n in SLICES)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    y0 = torch.randn(tokens, sum(SLICES), generator=gen).to(dtype)
    results = {}
    for name, buckets in (("unpadded", BucketPolicy.none()), ("pow2", BucketPolicy()), ("min64", BucketPolicy(minimum=64))):
        wrapper = HpuPunicaWrapper(LoRAEngine(variant, buckets))
        wrapper.set_slots(slots, slots)
        y = y0.clone()
        wrapper.add_lora_linear(y, x, a, b, SCALE, SLICES)
        results[name] = y
    no_adapter = slots == -1
    for name in ("pow2", "min64"):
        # CPU GEMM kernels may block differently for another row count, which can move a sum by an
        # ulp; a padding or routing error would be O(1).
        ulps = 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(results[name], results["unpadded"], rtol=ulps, atol=ulps)
        assert torch.equal(results[name][no_adapter], y0[no_adapter])


# -- the fused-MoE methods: pairs as rows, (slot, expert) as virtual slots --------------------------

E, TOP_K, INTER = 4, 2, 24  # experts, choices per token, intermediate size


def moe_weights(gen: torch.Generator) -> dict:
    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(DTYPE)

    return {
        "w13_a": tuple(rand(L, E, R, H, fan_in=H) for _ in range(2)),
        "w13_b": tuple(rand(L, E, INTER, R, fan_in=R) for _ in range(2)),
        "w2_a": (rand(L, E, R, INTER, fan_in=INTER),),
        "w2_b": (rand(L, 1, H, R, fan_in=R),),  # shared-expert LoRA-B
    }


def run_moe_batch(wrapper: HpuPunicaWrapper, w: dict, token_slots: list[int], routing: list[list[int]], gen) -> dict:
    T = len(token_slots)
    wrapper.set_slots(torch.tensor(token_slots), torch.tensor(token_slots[:1]))
    topk_ids = torch.tensor(routing, dtype=torch.int32)
    topk_weights = torch.rand(T, TOP_K, generator=gen)
    enabled = torch.tensor([1, 1, 0, 1, 0], dtype=torch.int32)  # slot 2 has no MoE LoRA
    out = {
        "w13": torch.randn(T, TOP_K, 2 * INTER, generator=gen).to(DTYPE),
        "w2": torch.randn(T, TOP_K, H, generator=gen).to(DTYPE),
    }
    x = torch.randn(T, H, generator=gen).to(DTYPE)
    inter = torch.randn(T * TOP_K, INTER, generator=gen).to(DTYPE)
    wrapper.add_lora_w13(out["w13"], x, w["w13_a"], w["w13_b"], topk_ids, topk_weights, enabled)
    wrapper.add_lora_w2(out["w2"], inter, w["w2_a"], w["w2_b"], topk_ids, topk_weights, enabled)
    return out


# One bucket (5–8 tokens → 8) with different adapter mixes, disabled slots, routings, a hot expert.
MOE_SAME_BUCKET = [
    ([0, 0, 1, 1, 2, 2, 3, 3], [[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3], [2, 0], [3, 1]]),
    ([-1] * 5, [[0, 1]] * 5),  # no adapter, fewer tokens
    ([3, -1, 3, 2, 3, -1, 3], [[1, 1], [0, 3], [1, 2], [1, 0], [1, 3], [2, 2], [1, 0]]),  # hot expert 1, duplicates
    ([1] * 8, [[3, 2]] * 8),
    ([2, 2, 2, 2, 2, 2], [[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]),  # only a disabled slot
]


@pytest.mark.parametrize("variant", ["mask", "gather"])
def test_routing_changes_within_a_bucket_never_recompile(variant):
    backend = CountingBackend()
    compiled = HpuPunicaWrapper(LoRAEngine(variant, BucketPolicy(), CpuDeviceLayer(compile_backend=backend)))
    eager = HpuPunicaWrapper(LoRAEngine(variant, BucketPolicy()))
    w = moe_weights(torch.Generator().manual_seed(0))

    run_moe_batch(compiled, w, *MOE_SAME_BUCKET[0], torch.Generator().manual_seed(1))  # warm-up
    graphs_after_warm_up = backend.graphs
    assert graphs_after_warm_up > 0
    for i, (tokens, routing) in enumerate(MOE_SAME_BUCKET):
        got = run_moe_batch(compiled, w, tokens, routing, torch.Generator().manual_seed(10 + i))
        want = run_moe_batch(eager, w, tokens, routing, torch.Generator().manual_seed(10 + i))
        for name in got:
            assert torch.equal(got[name], want[name]), name
    assert backend.graphs == graphs_after_warm_up, "a routing of the same bucket recompiled a core function"

    # Control: 16 tokens are another bucket and compile new graphs.
    run_moe_batch(compiled, w, [0, 1] * 8, [[0, 1], [2, 3]] * 8, torch.Generator().manual_seed(99))
    assert backend.graphs > graphs_after_warm_up


@pytest.mark.parametrize("variant", ["mask", "gather"])
def test_unused_slots_and_experts_contribute_exactly_nothing(variant):
    """Inf in the weights of every slot and expert no pair uses changes no bit of the result."""
    w = moe_weights(torch.Generator().manual_seed(0))
    poisoned = {name: tuple(s.clone() for s in stacks) for name, stacks in w.items()}
    for stacks in poisoned.values():
        for stack in stacks:
            stack[0, :] = float("inf")  # slot 0: used by no token below
            if stack.size(1) > 1:
                stack[:, 3] = float("inf")  # expert 3: chosen by no token below
    tokens, routing = [1, -1, 3, 1, 3], [[0, 1], [2, 0], [1, 2], [2, 2], [0, 1]]
    clean = run_moe_batch(HpuPunicaWrapper(LoRAEngine(variant)), w, tokens, routing, torch.Generator().manual_seed(5))
    dirty = run_moe_batch(HpuPunicaWrapper(LoRAEngine(variant)), poisoned, tokens, routing, torch.Generator().manual_seed(5))
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), name
