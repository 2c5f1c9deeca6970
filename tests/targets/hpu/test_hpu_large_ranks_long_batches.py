"""Ranks above 256 and batches above 2,048 rows on the HPU implementation (issue 23).

vLLM accepts ``max_lora_rank`` up to 512 (320 and 512 above 256) and batches up to its default
``max_num_batched_tokens`` of 8,192. The implementation keeps no list of ranks and pads no rank: the stacks'
R is a static dimension of every graph (the mask ``[T, L·R]``, the shrink buffer ``[S, T, R]``), and only the
row count is bucketed. These tests check that

* ``hpu-emulated`` and its gather variant pass cases of ranks 320 and 512 of every op, dense and MoE, and
  batches of more than 2,048 rows of every op (tokens; sampled rows for the logits and heads);
* under ``torch.compile(dynamic=False)`` a rank of 320 or 512 compiles exactly as many graphs as a rank of 8
  (one set per bucket and configuration, nothing per rank bucket), and adapter mixes of one bucket never
  recompile;
* batches of 2,049–8,192 rows fall into two buckets (4,096 and 8,192 under ``pow2``), and batches of one
  bucket share its graphs;
* the standard profile's cases of the families ``rank_512``, ``long_batch`` and ``long_sampled`` all pass
  (a sweep: ``slow``).
"""

from __future__ import annotations

import pytest
import torch
from graph_counting import CountingBackend, fresh_dynamo
from profile_runs import run_profile

from conformance.cases.features import LONG_BATCH
from conformance.generator import PROFILES, profile_cases
from conformance.ops import OP_SPECS
from conformance.runner import run_case
from conformance.targets.describe import probe_case
from conformance.targets.hpu import BucketPolicy, HpuEmulatedGatherTarget, HpuEmulatedTarget, HpuPunicaWrapper, LoRAEngine
from conformance.targets.hpu.device import CpuDeviceLayer
from conformance.verdict import Outcome

LARGE_RANKS = (320, 512)
TARGETS = {"hpu-emulated": HpuEmulatedTarget, "hpu-emulated-gather": HpuEmulatedGatherTarget}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return TARGETS[request.param]()


def _case(op: str, seq_lens: tuple[int, ...], seq_slots: tuple[int, ...], rank: int, dtype: str = "bfloat16"):
    """A probe case of ``op`` over these sequences (two slots: the second an odd rank below R, zero-padded);
    an MoE op routes every token to two experts of two."""
    changes = {"seq_lens": seq_lens, "seq_slots": seq_slots, "max_rank": rank, "adapter_ranks": (rank, rank - 7)}
    if "routing" in OP_SPECS[op].knobs:
        changes["topk_ids"] = tuple((t % 2, (t + 1) % 2) for t in range(sum(seq_lens)))
    return probe_case(op, dtype, **changes)


@pytest.mark.parametrize("rank", LARGE_RANKS)
@pytest.mark.parametrize("op", list(OP_SPECS))
def test_ranks_320_and_512_pass_on_every_op(target, op, rank):
    case = _case(op, (3, 2, 1, 2), (0, -1, 1, 0), rank)
    result = run_case(target, case, f"{op}-r{rank}")
    assert result.outcome is Outcome.PASS, result.message


@pytest.mark.parametrize("op", list(OP_SPECS))
def test_batches_beyond_2048_rows_pass_on_every_op(op):
    """2,049 rows reach the op: tokens (two sequences, the one beyond row 2,048 served), or sampled rows."""
    if OP_SPECS[op].rows == "sampled":
        seq_lens, seq_slots = (1,) * (LONG_BATCH + 1), tuple((-1, 0, 1)[i % 3] for i in range(LONG_BATCH + 1))
    else:
        seq_lens, seq_slots = (1000, LONG_BATCH + 1 - 1000), (-1, 1)
    case = _case(op, seq_lens, seq_slots, 16)
    result = run_case(HpuEmulatedTarget(), case, f"{op}-long")
    assert result.outcome is Outcome.PASS, result.message


# -- compiled graphs: what a large rank or a long batch costs in shapes --------------------------------


@pytest.fixture
def dynamo_reset():
    with fresh_dynamo():
        yield


L, H, N, E = 2, 16, 24, 2
DTYPE = torch.bfloat16


def _stacks(rank: int, gen: torch.Generator) -> dict:
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(DTYPE)

    return {"a": (rand(L, rank, H),), "b": (rand(L, N, rank),), "moe_a": (rand(L, E, rank, H),), "moe_b": (rand(L, E, N, rank),)}


def _batch(wrapper: HpuPunicaWrapper, w: dict, rank: int, slots: list[int], gen: torch.Generator) -> None:
    """add_lora_linear, add_shrink into the float32 [1, T, R] buffer, add_expand from it, add_lora_w13."""
    T = len(slots)
    wrapper.set_slots(torch.tensor(slots), torch.tensor(slots[:2]))
    x = torch.randn(T, H, generator=gen).to(DTYPE)
    wrapper.add_lora_linear(torch.zeros(T, N, dtype=DTYPE), x, w["a"], w["b"], 0.5, (N,))
    buffer = torch.zeros(1, T, rank)
    wrapper.add_shrink(buffer, x, w["a"], 0.5)
    wrapper.add_expand(torch.zeros(T, N, dtype=DTYPE), buffer, w["b"], (N,), add_inputs=True)
    topk_ids = torch.tensor([[t % E] for t in range(T)], dtype=torch.int32)
    wrapper.add_lora_w13(torch.zeros(T, 1, N, dtype=DTYPE), x, w["moe_a"], w["moe_b"], topk_ids, torch.ones(T, 1),
                         torch.ones(L + 1, dtype=torch.int32))


# Batches of one bucket (5–8 rows → 8) with different adapter mixes.
SAME_BUCKET = ([0, 1, 0, 1, -1, 0, 1, 1], [-1] * 5, [1, 1, 1, 1, 1, 1], [0, -1, 1, -1, 0, -1, 1])


def _graphs(rank: int, variant: str = "mask") -> tuple[int, int]:
    """(graphs after the first batch, graphs after every batch of the same bucket) at stack rank ``rank``."""
    backend = CountingBackend()
    wrapper = HpuPunicaWrapper(LoRAEngine(variant, BucketPolicy(), CpuDeviceLayer(compile_backend=backend)))
    w = _stacks(rank, torch.Generator().manual_seed(rank))
    gen = torch.Generator().manual_seed(0)
    _batch(wrapper, w, rank, SAME_BUCKET[0], gen)
    warm = backend.graphs
    for slots in SAME_BUCKET:
        _batch(wrapper, w, rank, slots, gen)
    return warm, backend.graphs


@pytest.mark.parametrize("variant", ["mask", "gather"])
def test_a_large_rank_compiles_the_graphs_of_a_small_one_and_never_recompiles_in_a_bucket(dynamo_reset, variant):
    small_warm, small_all = _graphs(8, variant)
    assert small_warm > 0 and small_all == small_warm
    for rank in LARGE_RANKS:
        torch._dynamo.reset()
        # the same number of graphs as rank 8 (no rank bucket, no padding to a power of two), none added by
        # another adapter mix of the same bucket
        assert _graphs(rank, variant) == (small_warm, small_warm), f"rank {rank}"


def test_long_batches_fall_into_two_buckets_and_share_their_graphs(dynamo_reset):
    low, high = PROFILES["standard"].limits.long_batch  # the rows of the long_batch and long_sampled families
    assert {BucketPolicy().bucket(rows) for rows in range(low, high + 1)} == {4096, 8192}

    backend = CountingBackend()
    wrapper = HpuPunicaWrapper(LoRAEngine("mask", BucketPolicy(), CpuDeviceLayer(compile_backend=backend)))
    w = _stacks(16, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    _batch(wrapper, w, 16, [0, 1, -1] * 700, gen)  # 2,100 rows: bucket 4,096
    warm = backend.graphs
    _batch(wrapper, w, 16, [1, -1] * 1800 + [0], gen)  # 3,601 rows: the same bucket, no new graph
    assert backend.graphs == warm


# -- the standard profile's large-rank and long-batch cases (a sweep) ----------------------------------


@pytest.mark.slow  # a correct target's sweep of every case of three families of the standard profile
def test_emulated_target_passes_the_standard_large_rank_and_long_batch_cases():
    cases = [(i, c) for i, c in profile_cases("standard") if c.family in ("rank_512", "long_batch", "long_sampled")]
    assert {c.max_rank for _, c in cases} >= set(LARGE_RANKS)
    outcomes, failures = run_profile(HpuEmulatedTarget(), cases)
    assert not failures, failures[:10]
    assert outcomes[Outcome.PASS] == len(cases)
