"""The tensor-parallel cases of each profile, drawn deterministically from the run seed.

* ``smoke``: every layer kind, fully sharded and not, at TP 2 and 4, and the QKV layer again with
  its kv heads shared by two ranks each (vLLM's ``num_kv_head_replicas``, as when a model has fewer kv
  heads than ranks), in float32: 20 cases, each of family ``neg1_last_slot`` (a batch with rows of
  slot −1 beside rows of the last slot: the rows a wrapper most often gets wrong, and the ones vLLM's
  CPU ops hand the last slot's adapter);
* ``standard`` and ``release``: those layers × sharding × TP {2, 4} × dtype {float16, bfloat16,
  float32}, one ``neg1_last_slot`` and one ``random`` batch each: 120 cases.

Widths are small (a TP case checks how the shards compose, which the op cases' sizes do not change)
and every width vLLM divides is a multiple of 4, so of both TP sizes; q and k/v widths differ.
"""

from __future__ import annotations

import random

from .case import LAYERS, TP_SIZES, TPCase

TP_DTYPES = ("float32", "bfloat16", "float16")
FAMILIES = ("neg1_last_slot", "random")

LAYER_KINDS = tuple((layer, 1) for layer in LAYERS) + (("qkv", 2),)
"""Each layer kind with its kv-head replication: every kind unreplicated, and QKV with two ranks per kv head."""
HIDDEN_SIZES = (16, 32, 64, 128)
RANKS = (4, 8, 16)
SCALES = (1.0, 0.5, 2.0)


def _widths(layer: str, rng: random.Random) -> tuple[int, ...]:
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
    lens = [rng.randint(1, 6) if is_prefill else 1 for _ in slots]
    return tuple(lens), tuple(slots), num_slots, is_prefill


def draw_case(layer: str, fully_sharded: bool, tp_size: int, dtype: str, family: str, seed: int, kv_replicas: int = 1) -> TPCase:
    """One case, its structure and value seed from ``seed`` and its coordinates (the same on every machine)."""
    replicated = f"/kv{kv_replicas}" if kv_replicas > 1 else ""  # the cases without replicas stay as they were
    rng = random.Random(f"tp/{seed}/{layer}/{fully_sharded}/{tp_size}/{dtype}/{family}{replicated}")
    seq_lens, seq_slots, num_slots, is_prefill = _batch(family, rng)
    return TPCase(
        layer=layer, fully_sharded=fully_sharded, tp_size=tp_size, dtype=dtype, seq_lens=seq_lens, seq_slots=seq_slots,
        num_slots=num_slots, max_rank=rng.choice(RANKS), hidden_size=rng.choice(HIDDEN_SIZES),
        output_slices=_widths(layer, rng), scale=rng.choice(SCALES), is_prefill=is_prefill,
        seed=rng.randrange(2**31), family=family, kv_replicas=kv_replicas,
    )


def tp_cases(profile: str, seed: int = 0) -> list[TPCase]:
    """The profile's TP cases, grouped by TP size so that a worker's rank pool starts once per size."""
    dtypes, families = (("float32",), FAMILIES[:1]) if profile == "smoke" else (TP_DTYPES, FAMILIES)
    return [
        draw_case(layer, fully_sharded, tp_size, dtype, family, seed, kv_replicas)
        for tp_size in TP_SIZES
        for layer, kv_replicas in LAYER_KINDS
        for fully_sharded in (False, True)
        for dtype in dtypes
        for family in families
    ]
