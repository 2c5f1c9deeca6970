"""The tensor-parallel serving cases of a profile: every serving family on vLLM's sharded linear LoRA layers.

Case ``i`` serves family ``SCENARIOS[i % 8]`` (``conformance.serving.scenarios``: the same sequences as one
process serves) on layer kind ``SERVING_LAYERS[(i + 5 · (i // 8)) % 10]`` at TP size 2 or 4 in turns of
eight cases (so 80 cases pair every family with every kind, and 16 hold every family at both sizes and
every kind), everything else drawn from ``(seed, i)``; the cases are ordered by TP size, so a target's rank
pool starts once per size. Smoke: 16 cases; standard 40; release 80.
"""

from __future__ import annotations

import random

from conformance.serving.scenarios import SCENARIOS, schedule

from .case import TP_SIZES, TPCase
from .cases import HIDDEN_SIZES, INDEXER_REPLICAS, slice_widths
from .serving_case import TPServingCase

SERVING_LAYERS = (("column", False, 1), ("column", True, 1), ("merged_column", False, 1), ("merged_column", True, 1),
                  ("qkv", False, 1), ("qkv", True, 1), ("qkv", False, 2), ("row", False, 1), ("row", True, 1),
                  ("qkv_indexer", False, 0))
"""Each ``(layer, fully_sharded, kv_replicas)``: every linear layer kind of ``conformance.tp.case``, fully sharded
and not, QKV with two ranks per kv head, and vLLM 0.33's seven-slice QKV + indexer layer (0: its head
replication at the case's TP size, ``conformance.tp.cases.INDEXER_REPLICAS``)."""
PROFILE_CASES = {"smoke": 16, "standard": 40, "release": 80}
DTYPES = ("float16", "bfloat16")


def tp_serving_case(seed: int, index: int) -> TPServingCase:
    """Case ``index`` of a profile drawn from ``seed``."""
    rng = random.Random(f"serving-tp:{seed}:{index}")
    family = SCENARIOS[index % len(SCENARIOS)]
    turn = index // len(SCENARIOS)
    layer_kind, fully_sharded, kv_replicas = SERVING_LAYERS[(index + 5 * turn) % len(SERVING_LAYERS)]
    tp_size = TP_SIZES[turn % len(TP_SIZES)]
    kv_replicas, index_kv_replicas = INDEXER_REPLICAS[tp_size] if not kv_replicas else (kv_replicas, 1)
    num_slots, max_rank = rng.choice((2, 3)), rng.choice((8, 16))
    max_tokens = 48
    sizes = (rng.choice((4, 8)), 16)
    policy = "no_adapters" if family == "capture_without_adapters" else rng.choice(("per_count", "max_count", "no_adapters"))
    graphs, steps, pool = schedule(rng, family, num_slots, sizes, policy, max_tokens)
    ranks = tuple(rng.choice(sorted({1, 4, 5, max_rank // 2, max_rank})) for _ in range(pool))
    layer = TPCase(layer=layer_kind, fully_sharded=fully_sharded, tp_size=tp_size, dtype=rng.choice(DTYPES), seq_lens=(1,),
                   seq_slots=(-1,), num_slots=num_slots, max_rank=max_rank, hidden_size=rng.choice(HIDDEN_SIZES[1:3]),
                   output_slices=slice_widths(layer_kind, rng), scale=rng.choice((0.5, 1.0, 2.0)), family=family, kv_replicas=kv_replicas,
                   index_kv_replicas=index_kv_replicas)
    return TPServingCase(family, layer, ranks, max_tokens, policy, graphs, steps, seed * 100_000 + index)


def tp_serving_cases(profile: str, seed: int) -> list[TPServingCase]:
    if profile not in PROFILE_CASES:
        raise ValueError(f"no tensor-parallel serving cases for profile {profile!r}: the profiles are {', '.join(PROFILE_CASES)}")
    cases = [tp_serving_case(seed, index) for index in range(PROFILE_CASES[profile])]
    return sorted(cases, key=lambda case: case.tp_size)  # stable: within a size, in index order
