"""The tensor-parallel cases of each profile, drawn deterministically from the run seed.

* ``smoke``: every linear layer kind, fully sharded and not, at TP 2 and 4, and the QKV layer again
  with its kv heads shared by two ranks each (vLLM's ``num_kv_head_replicas``, as when a model has
  fewer kv heads than ranks): 20 cases; vLLM 0.33's 7-slice QKV + indexer layer at TP 2 and 4 (2); and
  4 MoE LoRA cases (``SMOKE_MOE``): 26, in float32, each of family ``neg1_last_slot`` (a batch with rows
  of slot −1 beside rows of the last slot: the rows a wrapper most often gets wrong, and the ones
  vLLM's CPU ops hand the last slot's adapter);
* ``standard`` and ``release``: the linear and QKV + indexer layers × TP {2, 4} × dtype {float16,
  bfloat16, float32}, one ``neg1_last_slot`` and one ``random`` batch each (120 + 12), and the MoE
  kinds × padded or not × TP {2, 4} × dtype (36): 168 cases.

Widths are small (a TP case checks how the shards compose, which the op cases' sizes do not change)
and every width vLLM divides is a multiple of 4, so of both TP sizes; q and k/v widths differ. Every
draw is seeded by its coordinates, so adding a kind leaves the other cases as they were.
"""

from __future__ import annotations

import random

from conformance.cases import scales as adapter_scales

from .case import FULLY_SHARDED_LAYERS, TP_SIZES, TPCase
from .moe_case import MoETPCase

TP_DTYPES = ("float32", "bfloat16", "float16")
FAMILIES = ("neg1_last_slot", "random")

LAYER_KINDS = tuple((layer, 1) for layer in FULLY_SHARDED_LAYERS) + (("qkv", 2),)
"""Each layer kind with its kv-head replication: every kind unreplicated, and QKV with two ranks per kv head."""
HIDDEN_SIZES = (16, 32, 64, 128)
RANKS = (4, 8, 16)
SCALES = (1.0, *adapter_scales.SCALES)
"""1 and the scales of real adapter configs, most of them inexact in 16 bits (``conformance.cases.scales``)."""


def slice_widths(layer: str, rng: random.Random) -> tuple[int, ...]:
    if layer == "qkv_indexer":  # q, k, v, index_q, index_k, index_z, gate: seven unequal slices
        kv, index_kv = rng.choice((8, 16)), rng.choice((4, 8))
        return (rng.choice((2, 4)) * kv, kv, kv, rng.choice((16, 32)), index_kv, index_kv, rng.choice((4, 8)))
    if layer == "qkv":
        kv = rng.choice((8, 16))
        return (rng.choice((2, 4)) * kv, kv, kv)  # q wider than k and v, as with grouped-query attention
    if layer == "merged_column":
        return (rng.choice((16, 32, 48)), rng.choice((16, 32, 48)))
    return (rng.choice((16, 32, 48, 64)),)


def _batch(family: str, rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], int, bool]:
    """``(seq_lens, seq_slots, num_slots, is_prefill)``; ``neg1_last_slot`` has a −1 sequence and one of slot L−1."""
    num_slots = rng.randint(2, 4)
    is_prefill = rng.random() < 0.7
    count = rng.randint(2, 5)
    slots = [rng.randint(-1, num_slots - 1) for _ in range(count)]
    if family == "neg1_last_slot":
        no_adapter, last = rng.sample(range(count), 2)
        slots[no_adapter], slots[last] = -1, num_slots - 1
    elif all(slot == -1 for slot in slots):  # a batch no adapter serves checks no sharded LoRA at all
        slots[rng.randrange(count)] = rng.randrange(num_slots)
    lens = [rng.randint(1, 6) if is_prefill else 1 for _ in slots]
    return tuple(lens), tuple(slots), num_slots, is_prefill


def draw_case(layer: str, fully_sharded: bool, tp_size: int, dtype: str, family: str, seed: int, kv_replicas: int = 1,
              index_kv_replicas: int = 1) -> TPCase:
    """One case, its structure and value seed from ``seed`` and its coordinates (the same on every machine)."""
    replicated = f"/kv{kv_replicas}" if kv_replicas > 1 else ""  # the cases without replicas stay as they were
    replicated += f"/index_kv{index_kv_replicas}" if index_kv_replicas > 1 else ""
    rng = random.Random(f"tp/{seed}/{layer}/{fully_sharded}/{tp_size}/{dtype}/{family}{replicated}")
    seq_lens, seq_slots, num_slots, is_prefill = _batch(family, rng)
    return TPCase(
        layer=layer, fully_sharded=fully_sharded, tp_size=tp_size, dtype=dtype, seq_lens=seq_lens, seq_slots=seq_slots,
        num_slots=num_slots, max_rank=rng.choice(RANKS), hidden_size=rng.choice(HIDDEN_SIZES),
        output_slices=slice_widths(layer, rng), scale=rng.choice(SCALES), is_prefill=is_prefill,
        seed=rng.randrange(2**31), family=family, kv_replicas=kv_replicas, index_kv_replicas=index_kv_replicas,
    )


INDEXER_REPLICAS = {2: (1, 2), 4: (2, 4)}
"""The QKV + indexer layer's ``(kv_replicas, index_kv_replicas)`` at each TP size: one indexer k head (as in
DeepSeek-style sparse indexers), so every rank holds it; at TP 4 two ranks share each kv head too."""

MOE_KINDS = (("moe_w13", False), ("moe_w13", True), ("moe_w2", False))
"""vLLM's MoE LoRA under TP: w13 as gate and up slices (``FusedMoEWithLoRA``), w13 as one fused slice
(``FusedMoE3DWithLoRA``), w2; each with and without a padded per-rank intermediate size."""
SMOKE_MOE = {(2, "moe_w13", False, True), (4, "moe_w13", True, True), (2, "moe_w2", False, True), (4, "moe_w2", False, False)}
"""The smoke profile's MoE cases ``(tp_size, layer, fused_w13, padded)``: every kind, padded at both TP sizes."""


def draw_moe_case(layer: str, fused_w13: bool, padded: bool, tp_size: int, dtype: str, seed: int) -> MoETPCase:
    """One MoE case (family ``neg1_last_slot``). Padded: the per-rank intermediate size is no multiple of the
    alignment (8 or 16), so each rank allocates more rows than its shard; unpadded: alignment 1."""
    rng = random.Random(f"tp/{seed}/{layer}/{fused_w13}/{padded}/{tp_size}/{dtype}")
    seq_lens, seq_slots, num_slots, is_prefill = _batch("neg1_last_slot", rng)
    alignment = rng.choice((8, 16)) if padded else 1
    shard = rng.choice((6, 10, 12, 20)) if padded else rng.choice((8, 16, 24))
    experts = rng.choice((4, 8))
    # sometimes a slot some sequence uses has no MoE LoRA (adapter_enabled 0), never the last slot
    candidates = sorted({s for s in seq_slots if s not in (-1, num_slots - 1)})
    disabled = (rng.choice(candidates),) if candidates and rng.random() < 0.3 else ()
    return MoETPCase(
        layer=layer, tp_size=tp_size, dtype=dtype, seq_lens=seq_lens, seq_slots=seq_slots, num_slots=num_slots,
        max_rank=rng.choice(RANKS), hidden_size=rng.choice(HIDDEN_SIZES[:3]), intermediate_size=shard * tp_size,
        num_experts=experts, top_k=rng.randint(1, 3), alignment=alignment, fused_w13=fused_w13, disabled_slots=disabled,
        is_prefill=is_prefill, seed=rng.randrange(2**31), family="neg1_last_slot",
    )


def tp_cases(profile: str, seed: int = 0) -> list[TPCase | MoETPCase]:
    """The profile's TP cases, grouped by TP size so that a worker's rank pool starts once per size."""
    dtypes, families = (("float32",), FAMILIES[:1]) if profile == "smoke" else (TP_DTYPES, FAMILIES)
    cases: list[TPCase | MoETPCase] = []
    for tp_size in TP_SIZES:
        cases += [
            draw_case(layer, fully_sharded, tp_size, dtype, family, seed, kv_replicas)
            for layer, kv_replicas in LAYER_KINDS
            for fully_sharded in (False, True)
            for dtype in dtypes
            for family in families
        ]
        kv_replicas, index_kv_replicas = INDEXER_REPLICAS[tp_size]
        cases += [
            draw_case("qkv_indexer", False, tp_size, dtype, family, seed, kv_replicas, index_kv_replicas)
            for dtype in dtypes
            for family in families
        ]
        cases += [
            draw_moe_case(layer, fused, padded, tp_size, dtype, seed)
            for layer, fused in MOE_KINDS
            for padded in (False, True)
            for dtype in dtypes
            if profile != "smoke" or (tp_size, layer, fused, padded) in SMOKE_MOE
        ]
    return cases
