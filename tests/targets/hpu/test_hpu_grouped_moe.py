"""The grouped MoE LoRA variant (``conformance/targets/hpu/grouped_moe.py``) against the float64 reference.

* The block plan: every served pair sits at exactly one block position, in a block of its own
  (slot, expert), within the static bound ``B`` for adversarial routings (one hot group, every group
  one pair, nothing served); unserved pairs are nowhere.
* The wrapper methods ``add_lora_w13`` / ``add_lora_w2`` on a grouped engine agree with
  ``PunicaWrapperReference`` in float64 (to summation order) and in bfloat16 (within a few units of the
  last place of the float64 oracle), across shapes: slot −1 tokens, disabled adapters, an expert map,
  shared stacks, ``offset`` and ``add_inputs=False``, many experts (E = 128, 256) and top-k 8.
* Pairs that are not served come back bit-identical; an Inf in a (slot, expert) no pair uses changes nothing.
* The suite's own MoE cases catch seeded bugs of the variant (positions off by one, another group's weights,
  the routing weight dropped).
"""

from __future__ import annotations

import pytest
import torch

from conformance.generator import profile_cases
from conformance.reference import LoRAMapping, PunicaWrapperReference
from conformance.runner import run_case
from conformance.targets.hpu import HpuEmulatedTarget, HpuPunicaWrapper, LoRAEngine, grouped_moe
from conformance.targets.hpu.grouped_moe import block_plan, block_shape
from conformance.verdict import Outcome

# -- the block plan ----------------------------------------------------------------------------


def check_plan(slots: torch.Tensor, experts: torch.Tensor, experts_per_slot: int, num_slots: int) -> int:
    """Check the plan's invariants; return how many blocks the routing uses."""
    served = (slots >= 0) & (experts >= 0)
    pairs, groups = slots.numel(), num_slots * experts_per_slot
    shape = block_shape(pairs, groups)
    pair_at, position, block_group = block_plan(slots, experts, served, experts_per_slot, groups, shape.block, shape.blocks)
    assert pair_at.shape == (shape.positions,) and block_group.shape == (shape.blocks,)
    key = torch.where(served, slots * experts_per_slot + experts, groups)
    at = position[served]
    assert torch.equal(pair_at[at], torch.nonzero(served).flatten())  # a served pair sits where its position says
    assert torch.equal(block_group[at // shape.block], key[served])  # in a block of its own group
    assert bool((position[~served] == shape.positions).all())  # the others nowhere
    placed = pair_at[pair_at < pairs]
    assert torch.equal(placed.sort().values, torch.nonzero(served).flatten())  # each served pair exactly once
    used = int((-(-torch.bincount(key[served], minlength=groups) // shape.block)).sum())
    assert used <= shape.blocks
    assert int((block_group < groups).sum()) == used  # blocks past the used ones belong to no group
    return used


@pytest.mark.parametrize(
    ("name", "slots", "experts"),
    [
        ("one hot group", [1] * 40, [3] * 40),
        ("every group one pair", [s for s in range(4) for _ in range(8)], list(range(8)) * 4),
        ("nothing served", [-1] * 12, [0, 1, 2] * 4),
        ("mixed, non-local experts", [0, -1, 2, 3, 0, 1, 1, 3, 2, 0] * 3, [5, 1, -1, 7, 5, 0, 0, 2, 6, 5] * 3),
    ],
)
def test_block_plan_places_every_served_pair_once_within_the_bound(name, slots, experts):
    check_plan(torch.tensor(slots), torch.tensor(experts), 8, 4)


def test_block_plan_random_routings_stay_within_the_bound():
    gen = torch.Generator().manual_seed(3)
    for pairs in (1, 7, 64, 300, 5000):
        slots = torch.randint(-1, 4, (pairs,), generator=gen)
        experts = torch.randint(-1, 16, (pairs,), generator=gen)
        check_plan(slots, experts, 16, 4)


@pytest.mark.parametrize(("pairs", "slots", "experts"), [(1, 4, 128), (8, 4, 128), (512, 4, 128), (4096, 4, 8), (16384, 4, 128),
                                                         (16384, 4, 256), (3000, 2, 4)])
def test_the_worst_routing_fills_exactly_the_static_blocks(pairs, slots, experts):
    """Every non-empty group one pair past a multiple of b: the routing that wastes most fills all ``B`` blocks."""
    groups = slots * experts
    shape = block_shape(pairs, groups)
    nonempty = min(groups, pairs)
    key = torch.arange(nonempty)  # one pair per group first
    rest = torch.arange(pairs - nonempty) // shape.block % nonempty  # then whole blocks, round robin
    key = torch.cat((key, rest))
    assert check_plan(key // experts, key % experts, experts, slots) == shape.blocks
    assert shape.positions <= 1.5 * pairs  # the static rows: at most 1.5 × the padded pairs
    assert shape.block & (shape.block - 1) == 0 and shape.block <= 128
    if shape.block < 128:  # and the largest power of two that keeps that
        assert nonempty * (2 * shape.block - 1) * 2 > pairs


# -- the wrapper methods against the reference ---------------------------------------------------


def make_case(gen, *, tokens, experts, top_k, slots=4, rank=8, hidden=48, inter=40, dtype=torch.float64,
              expert_map=False, shared=None, disabled=(2,), no_adapter_every=4):
    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(dtype)

    global_experts = experts * 2 if expert_map else experts
    topk_ids = torch.rand(tokens, global_experts, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    emap = None
    if expert_map:  # every other global expert is local
        emap = torch.full((global_experts,), -1, dtype=torch.int32)
        emap[::2] = torch.arange(experts, dtype=torch.int32)
    token_slots = [(-1 if t % no_adapter_every == 0 else t % slots) for t in range(tokens)]
    enabled = torch.ones(slots + 1, dtype=torch.int32)
    enabled[list(disabled)] = 0
    enabled[slots] = 0
    e_a = 1 if shared == "a" else experts
    e_b = 1 if shared == "b" else experts
    return {
        "token_slots": token_slots, "slots": slots, "topk_ids": topk_ids, "expert_map": emap, "enabled": enabled,
        "topk_weights": torch.rand(tokens, top_k, generator=gen).softmax(1),
        "x13": rand(tokens, hidden, fan_in=1),
        "x2": rand(tokens * top_k, inter, fan_in=1),
        "w13_a": tuple(rand(slots, e_a, rank, hidden, fan_in=hidden) for _ in range(2)),
        "w13_b": tuple(rand(slots, experts, inter, rank, fan_in=rank) for _ in range(2)),
        "w2_a": (rand(slots, experts, rank, inter, fan_in=inter),),
        "w2_b": (rand(slots, e_b, hidden, rank, fan_in=rank),),
        "y13": rand(tokens, top_k, 2 * inter + 3, fan_in=1),
        "y2": rand(tokens, top_k, hidden, fan_in=1),
    }


def run(wrapper, c, *, offset=0, add_inputs=True) -> dict:
    tokens = len(c["token_slots"])
    wrapper.update_metadata(LoRAMapping(tuple(c["token_slots"]), tuple(c["token_slots"]), (1,) * tokens, True, c["slots"]))
    y13, y2 = c["y13"].clone(), c["y2"].clone()
    common = dict(expert_map=c["expert_map"], add_inputs=add_inputs)
    wrapper.add_lora_w13(y13, c["x13"], c["w13_a"], c["w13_b"], c["topk_ids"], c["topk_weights"], c["enabled"], offset=offset, **common)
    wrapper.add_lora_w2(y2, c["x2"], c["w2_a"], c["w2_b"], c["topk_ids"], c["topk_weights"], c["enabled"], **common)
    return {"w13": y13, "w2": y2}


def grouped() -> HpuPunicaWrapper:
    return HpuPunicaWrapper(LoRAEngine("mask", moe_variant="grouped"))


def as_f64(c: dict) -> dict:
    return {k: (tuple(t.double() for t in v) if isinstance(v, tuple) else v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in c.items()}


SHAPES = [
    pytest.param(dict(tokens=1, experts=8, top_k=2), id="decode-E8-top2"),
    pytest.param(dict(tokens=13, experts=8, top_k=2), id="T13-E8-top2"),
    pytest.param(dict(tokens=70, experts=8, top_k=2), id="T70-E8-top2-blocks"),
    pytest.param(dict(tokens=9, experts=128, top_k=8), id="T9-E128-top8"),
    pytest.param(dict(tokens=33, experts=256, top_k=8, rank=4, hidden=16, inter=8), id="T33-E256-top8"),
    pytest.param(dict(tokens=300, experts=4, top_k=4, slots=2, disabled=()), id="T300-E4-top4-large-blocks"),
    pytest.param(dict(tokens=20, experts=16, top_k=4, expert_map=True), id="expert-map"),
    pytest.param(dict(tokens=20, experts=16, top_k=2, shared="a"), id="shared-w13-a"),
    pytest.param(dict(tokens=20, experts=16, top_k=2, shared="b"), id="shared-w2-b"),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_matches_the_float64_reference(shape):
    c = make_case(torch.Generator().manual_seed(7), **shape)
    for offset, add_inputs in ((0, True), (3, False)):
        got = run(grouped(), c, offset=offset, add_inputs=add_inputs)
        want = run(PunicaWrapperReference("cpu"), c, offset=offset, add_inputs=add_inputs)
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("shape", SHAPES[1:6])
def test_grouped_in_bfloat16_is_within_a_few_ulps_of_the_float64_oracle(shape):
    c = make_case(torch.Generator().manual_seed(11), dtype=torch.bfloat16, **shape)
    got = run(grouped(), c)
    oracle = run(PunicaWrapperReference("cpu"), as_f64(c))
    baseline = run(PunicaWrapperReference("cpu"), c)  # the reference's own float32-accumulated result in bf16
    for name in got:
        err = (got[name].double() - oracle[name]).abs()
        base_err = (baseline[name].double() - oracle[name]).abs()
        ulp = oracle[name].abs().clamp(min=2**-20) * 2**-7  # one bf16 ulp, roughly
        assert float((err / ulp).max()) <= max(2.0, float((base_err / ulp).max())), name


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_pairs_not_served_stay_bit_identical(shape):
    c = make_case(torch.Generator().manual_seed(5), **shape)
    c["y13"][0] = float("nan")  # token 0 has no adapter (slot −1)
    c["y2"][0] = -0.0
    got = run(grouped(), c, add_inputs=False)
    served = torch.tensor([s >= 0 and c["enabled"][s] != 0 for s in c["token_slots"]])
    for name, before in (("w13", c["y13"]), ("w2", c["y2"])):
        kept = got[name][~served]
        assert torch.equal(kept.view(torch.int64), before[~served].view(torch.int64)), name
        assert bool(torch.isfinite(got[name][served]).all()), name


def test_inf_in_a_slot_and_expert_no_pair_uses_changes_nothing():
    c = make_case(torch.Generator().manual_seed(9), tokens=24, experts=8, top_k=2)
    used = {(s, int(e)) for t, s in enumerate(c["token_slots"]) if s >= 0 for e in c["topk_ids"][t]}
    unused = next((s, e) for s in range(4) for e in range(8) if (s, e) not in used)
    poisoned = dict(c)
    for name in ("w13_a", "w13_b", "w2_a", "w2_b"):
        stacks = tuple(t.clone() for t in c[name])
        for t in stacks:
            t[unused[0], unused[1] if t.size(1) > 1 else 0] = float("inf")
        poisoned[name] = stacks
    clean, dirty = run(grouped(), c), run(grouped(), poisoned)
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), name


# -- the suite catches a broken grouped variant ---------------------------------------------------------


def _late_positions(plan):
    def mutated(*args):
        pair_at, position, block_group = plan(*args)
        # every pair reads its neighbour's block position (both views of the plan: the write-back uses either)
        return pair_at.roll(1), position + 1, block_group

    return mutated


def _neighbouring_group(index):
    return lambda block_group, *rest: index(block_group + 1, *rest)  # each block multiplies the next group's weights


def _no_routing_weight(delta):
    return lambda *args: delta(*args[:6], None)  # slice_delta's block_weight: the routing weight per position


MUTATIONS = {
    "positions one late": (grouped_moe, "block_plan", _late_positions),
    "weights of the next group": (grouped_moe, "stack_index", _neighbouring_group),
    "routing weight dropped": (grouped_moe, "slice_delta", _no_routing_weight),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_suites_moe_cases_catch_a_broken_grouped_variant(monkeypatch, mutation):
    """The conformance cases judge this variant: each seeded bug fails some of the smoke profile's MoE cases,
    and the unmutated variant passes the same cases."""
    cases = [(i, c) for i, c in profile_cases("smoke", ops=("add_lora_w2",)) if c.num_tokens * c.top_k >= 8][:6]
    assert cases
    assert all(run_case(HpuEmulatedTarget(), c, i).outcome is Outcome.PASS for i, c in cases)
    module, name, mutate = MUTATIONS[mutation]
    monkeypatch.setattr(module, name, mutate(getattr(module, name)))
    outcomes = [run_case(HpuEmulatedTarget(), c, i).outcome for i, c in cases]
    assert any(o is not Outcome.PASS for o in outcomes), f"{mutation}: every case passed"
