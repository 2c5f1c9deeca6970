"""The grouped MoE LoRA compiles once per bucket: zero recompilations across routings and adapter mixes.

Under ``torch.compile(dynamic=False)`` with a backend that only counts graphs (``graph_counting``), the
``hpu-emulated`` target (whose MoE variant is ``grouped``) runs MoE cases of the smoke profile
(``add_lora_w13``, ``add_lora_w2``, ``fused_moe_lora``; twelve of each, spread over the profile), each judged by the suite's referee, then *twins* of
each case: the same shapes and bucket with another routing (every expert id moved on by one), another
adapter mix (every slot moved on by one) and, where the batch allows, one token fewer in the same bucket.
A twin must add no graph. The controls show the counter moves: a batch in another bucket compiles new
graphs, and so does a routing of the same bucket under ``BucketPolicy.none()`` (no padding).
"""

from __future__ import annotations

import dataclasses

import pytest
from graph_counting import CountingBackend, fresh_dynamo

from conformance.cases.case import Case
from conformance.generator import profile_cases
from conformance.runner import run_case
from conformance.targets.hpu import BucketPolicy, HpuEmulatedTarget
from conformance.targets.hpu.device import CpuDeviceLayer
from conformance.targets.hpu.grouped_moe import GroupedMoE
from conformance.verdict import Outcome

MOE_OPS = ("add_lora_w13", "add_lora_w2", "fused_moe_lora")
CASES_PER_OP = 12


class CompiledEmulatedTarget(HpuEmulatedTarget):
    """``hpu-emulated`` whose core functions run under ``torch.compile`` with a counting backend."""

    def __init__(self, backend: CountingBackend, buckets: BucketPolicy | None = None) -> None:
        self.backend = backend
        super().__init__(buckets=buckets)

    def device_layer(self) -> CpuDeviceLayer:
        return CpuDeviceLayer(compile_backend=self.backend)


def rerouted(case: Case) -> Case:
    """Same shapes, another routing and adapter mix: expert ids and slots moved on by one."""
    experts = case.global_experts
    topk_ids = tuple(tuple((e + 1) % experts for e in ids) for ids in case.topk_ids)
    seq_slots = tuple(s if s < 0 else (s + 1) % case.num_slots for s in case.seq_slots)
    return dataclasses.replace(case, topk_ids=topk_ids, seq_slots=seq_slots)


def one_token_fewer(case: Case) -> Case | None:
    """The case without its last token, when that keeps the bucket and the case stays well formed."""
    tokens = case.num_tokens
    if tokens < 2 or case.num_rows or case.seq_starts or case.seq_lens[-1] < 2:
        return None
    if BucketPolicy().bucket(tokens - 1) != BucketPolicy().bucket(tokens):
        return None
    pairs = (tokens - 1) * case.top_k
    return dataclasses.replace(
        case, seq_lens=(*case.seq_lens[:-1], case.seq_lens[-1] - 1), topk_ids=case.topk_ids[:-1],
        zero_weight_pairs=tuple(p for p in case.zero_weight_pairs if p < pairs),
    )


@pytest.fixture
def dynamo_reset():
    with fresh_dynamo():
        yield


def sample(cases: list, count: int) -> list:
    """``count`` cases spread evenly over the profile's order (every family's cases lie together)."""
    step = max(1, len(cases) // count)
    return cases[::step][:count]


@pytest.mark.parametrize("op", MOE_OPS)
def test_the_smoke_profiles_moe_cases_never_recompile_within_a_bucket(dynamo_reset, op):
    # Each case of the profile has shapes of its own (and compiles its graphs, seconds each on 2 cores):
    # a spread of them, not all of them, keeps this a unit test.
    cases = sample(profile_cases("smoke", ops=(op,)), CASES_PER_OP)
    assert cases, f"the smoke profile has no {op} case"
    backend = CountingBackend()
    target = CompiledEmulatedTarget(backend)
    assert isinstance(target.engine.moe_variant, GroupedMoE)
    twins_run = 0
    for case_id, case in cases:
        result = run_case(target, case, case_id)
        assert result.outcome is Outcome.PASS, f"{case_id}: {result.message}"
        compiled = backend.graphs
        for twin in (rerouted(case), one_token_fewer(case)):
            if twin is None:
                continue
            result = run_case(target, twin, f"{case_id}-twin")
            assert result.outcome is Outcome.PASS, f"{case_id} twin: {result.message}"
            assert backend.graphs == compiled, f"{case_id}: a twin of the same bucket recompiled"
            twins_run += 1
    assert backend.graphs > 0 and twins_run >= len(cases)


def test_controls_another_bucket_and_no_buckets_do_compile(dynamo_reset):
    case = min((c for _, c in profile_cases("smoke", ops=("add_lora_w13",)) if c.num_tokens >= 3), key=lambda c: c.num_tokens)
    backend = CountingBackend()
    target = CompiledEmulatedTarget(backend)
    run_case(target, case)
    warm = backend.graphs
    tokens = 2 * case.num_tokens + 1  # past the next power of two
    doubled = dataclasses.replace(case, seq_lens=(*case.seq_lens[:-1], case.seq_lens[-1] + tokens - case.num_tokens),
                                  topk_ids=tuple(case.topk_ids[t % case.num_tokens] for t in range(tokens)))
    assert BucketPolicy().bucket(doubled.num_tokens) != BucketPolicy().bucket(case.num_tokens)
    assert run_case(target, doubled).outcome is Outcome.PASS
    assert backend.graphs > warm, "a new bucket compiled nothing: the counter is not counting"

    unbucketed = CompiledEmulatedTarget(CountingBackend(), BucketPolicy.none())
    run_case(unbucketed, case)
    warm = unbucketed.backend.graphs
    shorter = one_token_fewer(case) or dataclasses.replace(case, seq_lens=(*case.seq_lens, 1), seq_slots=(*case.seq_slots, 0),
                                                          topk_ids=(*case.topk_ids, case.topk_ids[0]))
    run_case(unbucketed, shorter)
    assert unbucketed.backend.graphs > warm, "without buckets another token count must compile"
