"""The serving cases of a profile: sequences of steps aimed at the bugs that live between steps.

Each family is one class of serving bug reported upstream (docs/serving.md has the threads); its
sequence is built to provoke it, with everything else (shapes, adapters, ranks, batch sizes, which
sequences carry which adapter) drawn from the case's seed by ``random.Random``, so a case is a pure
function of ``(profile, seed, index)``:

* ``stale_tail``: a full batch, then smaller ones padded into the same graph: rows past the real ones
  hold the earlier step's tokens and metadata (sglang #29157, #28371);
* ``count_rounding``: batches of k adapters beside base requests, served by the graph of the rounded-up
  count (vLLM rounds ``num_active_loras`` to the captured counts; −1 sorts first and needs a program of its own);
* ``capture_without_adapters``: graphs captured with no adapter active and replayed with adapters, as
  vllm-gaudi and SGLang capture (a "no LoRA" flag read at capture stays frozen);
* ``alternating_sizes``: two captured sizes replayed in turn, each with a new mapping (sglang #23727: a
  second capture overwrote the first graph's metadata);
* ``evict_reload``: an adapter evicted and another loaded into its slot between steps of the same slot
  pattern (captured addresses, vLLM's mapping cache);
* ``eager_overflow``: batches above the largest captured size run eagerly between replays;
* ``prefill_decode``: prefill and decode steps in turn;
* ``mixed``: a random walk over all of the above.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from conformance.cases.case import Case

from .case import ServingCase, ServingStep

SCENARIOS = ("stale_tail", "count_rounding", "capture_without_adapters", "alternating_sizes", "evict_reload",
             "eager_overflow", "prefill_decode", "mixed")
# The layers a serving case drives: the wrapper methods a LoRA layer calls per forward pass.
SERVING_OPS = ("add_lora_linear", "add_lora_embedding", "add_lora_logits", "add_lora_w13", "add_lora_w2")
DTYPES = ("float16", "bfloat16")
PROFILE_CASES = {"smoke": 120, "standard": 400, "release": 800}


def captured_adapter_counts(policy: str, num_slots: int) -> tuple[int, ...]:
    """The adapter counts graphs are captured for, 0 (no adapter) included: vLLM's ``get_captured_lora_counts``
    (every power of two up to ``max_loras + 1``, and ``max_loras + 1``) under ``per_count``; none and
    ``max_loras + 1`` under ``max_count``; none only under ``no_adapters``."""
    if policy == "no_adapters":
        return (0,)
    if policy == "max_count":
        return (0, num_slots + 1)
    powers = [1 << i for i in range(8) if 1 << i <= num_slots + 1]
    return (0, *sorted(set(powers) | {num_slots + 1}))


def graph_count(policy: str, num_slots: int, active: int) -> int:
    """The captured count that serves a batch of ``active`` distinct adapters (rounded up, as vLLM's dispatcher does;
    under ``no_adapters`` the one graph of the size serves every batch)."""
    if policy == "no_adapters":
        return 0
    return min(count for count in captured_adapter_counts(policy, num_slots) if count >= min(active, num_slots + 1))


@dataclass
class _Builder:
    """The state a scenario walks: which adapter each slot holds, and the steps so far."""

    rng: random.Random
    num_slots: int
    pool: int
    sizes: tuple[int, ...]
    policy: str
    max_tokens: int
    eager_only: bool = False  # every step eager (a layer run outside the captured forward)
    graphs: list[tuple[int, int]] = field(default_factory=list)
    steps: list[ServingStep] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)
    last_used: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.resident = list(range(self.num_slots))  # the server loads its first adapters at start-up
        self.last_used = [0] * self.num_slots

    def capture_all(self) -> None:
        """Every graph key, largest first, each by a dummy decode batch (as vLLM captures at start-up)."""
        counts = captured_adapter_counts(self.policy, self.num_slots)
        for size in sorted(self.sizes, reverse=True):
            for count in sorted(counts, reverse=True):
                self.graphs.append((size, count))
                adapters = [self.resident[i % self.num_slots] for i in range(size)] if count else [-1] * size
                if 0 < count <= self.num_slots:
                    adapters = [self.resident[i % count] for i in range(size)]
                self.steps.append(ServingStep("capture", (1,) * size, tuple(adapters), False, tuple(self.resident), size,
                                              len(self.graphs) - 1))

    def load(self, wanted: list[int]) -> None:
        """Make every adapter of ``wanted`` resident, evicting the least recently used others (weights overwritten in place)."""
        clock = len(self.steps) + 1
        for adapter in dict.fromkeys(a for a in wanted if a >= 0):
            if adapter in self.resident:
                self.last_used[self.resident.index(adapter)] = clock
                continue
            free = [s for s in range(self.num_slots) if self.resident[s] not in wanted]
            slot = min(free, key=lambda s: self.last_used[s])
            self.resident[slot], self.last_used[slot] = adapter, clock

    def step(self, tokens: int, *, prefill: bool | None = None, adapters: int | None = None, base: bool | None = None,
             eager: bool = False) -> None:
        """A real batch of ``tokens`` tokens with ``adapters`` distinct adapters (and base requests if ``base``)."""
        rng = self.rng
        prefill = rng.random() < 0.5 if prefill is None else prefill
        seqs = tokens if not prefill else max(1, min(tokens, rng.randint(1, 4)))
        lens = _split(rng, tokens, seqs)
        distinct = rng.randint(0, min(self.num_slots, seqs)) if adapters is None else min(adapters, self.num_slots, seqs)
        chosen = rng.sample(range(self.pool), distinct)
        with_base = (rng.random() < 0.5 if base is None else base) and seqs > distinct
        seq_adapters = [chosen[i % distinct] if distinct else -1 for i in range(seqs)]
        if with_base:
            for i in rng.sample(range(distinct, seqs) if distinct < seqs else [], max(1, (seqs - distinct) // 2)):
                seq_adapters[i] = -1
        rng.shuffle(seq_adapters)
        self.load(seq_adapters)
        active = len({a for a in seq_adapters if a >= 0})
        fitting = [size for size in sorted(self.sizes) if size >= tokens]
        if eager or not fitting or self.eager_only:
            self.steps.append(ServingStep("eager", tuple(lens), tuple(seq_adapters), prefill, tuple(self.resident), tokens))
            return
        key = (fitting[0], graph_count(self.policy, self.num_slots, active))
        self.steps.append(ServingStep("replay", tuple(lens), tuple(seq_adapters), prefill, tuple(self.resident), fitting[0],
                                      self.graphs.index(key)))

    def evict_into(self, slot: int) -> None:
        """Load an adapter not resident into ``slot`` (the one it held is evicted)."""
        outside = [a for a in range(self.pool) if a not in self.resident]
        if outside:
            self.resident[slot] = self.rng.choice(outside)


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``total`` tokens over ``parts`` sequences of at least one token each."""
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _walk(family: str, b: _Builder) -> None:
    """The steps after the captures, for ``family``."""
    rng, small, big = b.rng, min(b.sizes), max(b.sizes)
    if family == "stale_tail":
        for _ in range(2):
            b.step(big, adapters=b.num_slots)
            b.step(rng.randint(small + 1, big - 1) if big - small > 1 else big)
            b.step(rng.randint(1, small))
    elif family == "count_rounding":
        for k in range(1, b.num_slots + 1):
            b.step(rng.randint(max(2, k + 1), big), adapters=k, base=True, prefill=False)
    elif family == "capture_without_adapters":
        for _ in range(4):
            b.step(rng.randint(2, big), adapters=rng.randint(1, b.num_slots), base=rng.random() < 0.5)
    elif family == "alternating_sizes":
        for i in range(6):
            b.step(rng.randint(small // 2 + 1, small) if i % 2 == 0 else rng.randint(small + 1, big))
    elif family == "evict_reload":
        for _ in range(3):
            tokens = rng.randint(2, big)
            b.step(tokens, adapters=b.num_slots, prefill=False)
            previous = b.steps[-1]
            b.evict_into(rng.randrange(b.num_slots))
            # the same slots per sequence, other weights in one of them
            adapters = tuple(b.resident[s] if s >= 0 else -1 for s in previous.seq_slots)
            b.steps.append(ServingStep(previous.mode, previous.seq_lens, adapters, previous.is_prefill, tuple(b.resident),
                                       previous.rows, _graph_for(b, previous, adapters)))
    elif family == "eager_overflow":
        for _ in range(2):
            b.step(rng.randint(big + 1, b.max_tokens))
            b.step(rng.randint(1, big))
    elif family == "prefill_decode":
        for i in range(5):
            b.step(rng.randint(2, big), prefill=i % 2 == 0)
    else:  # mixed
        for _ in range(rng.randint(4, 7)):
            b.step(rng.randint(1, b.max_tokens if rng.random() < 0.2 else big))


def _graph_for(b: _Builder, like: ServingStep, adapters: tuple[int, ...]) -> int:
    if like.graph < 0:
        return -1
    active = len({a for a in adapters if a >= 0})
    return b.graphs.index((like.rows, graph_count(b.policy, b.num_slots, active)))


def _layer(rng: random.Random, op: str, dtype: str, num_slots: int, max_rank: int, max_tokens: int) -> Case:
    """The layer's shape as an op case (its batch fields are the step's: ``ServingCase.step_case``)."""
    hidden = rng.choice((33, 64, 128))
    common = dict(op=op, dtype=dtype, seq_lens=(max_tokens,), seq_slots=(-1,), num_slots=num_slots, max_rank=max_rank,
                  adapter_ranks=(max_rank,) * num_slots, hidden_size=hidden, scale=rng.choice((0.5, 1.0, 2.0)))
    if op == "add_lora_linear":
        slices = tuple(rng.choice((16, 48, 64)) for _ in range(rng.randint(1, 3)))
        return Case(output_slices=slices, output_width=sum(slices), **common)
    if op in ("add_lora_embedding", "add_lora_logits"):
        width = rng.choice((64, 100, 128))
        return Case(output_slices=(width,), output_width=width, **common)
    experts, top_k = rng.choice((4, 8)), 2
    width = rng.choice((16, 32))
    slices = (width, width) if op == "add_lora_w13" else (width,)
    routing = tuple(tuple(rng.sample(range(experts), top_k)) for _ in range(max_tokens))
    return Case(output_slices=slices, output_width=sum(slices), num_experts=experts, top_k=top_k, topk_ids=routing,
                routed_weight=op == "add_lora_w2", block_size=16, **common)


def serving_case(seed: int, index: int) -> ServingCase:
    """Case ``index`` of a profile drawn from ``seed``: its family and op by index (every pair covered), the rest drawn."""
    rng = random.Random(f"serving:{seed}:{index}")
    family = SCENARIOS[index % len(SCENARIOS)]
    op = SERVING_OPS[(index // len(SCENARIOS)) % len(SERVING_OPS)]
    num_slots, max_rank = rng.choice((2, 3, 4)), rng.choice((8, 16))
    max_tokens = 64
    small = rng.choice((4, 8))
    sizes = (small, rng.choice((16, 32)))
    policy = "no_adapters" if family == "capture_without_adapters" else rng.choice(("per_count", "max_count", "no_adapters"))
    eager_only = op == "add_lora_logits"  # vLLM computes logits after the captured forward, unpadded
    graphs, steps, pool = schedule(rng, family, num_slots, sizes, policy, max_tokens, eager_only)
    ranks = tuple(rng.choice(sorted({1, 4, 5, max_rank // 2, max_rank})) for _ in range(pool))
    layer = _layer(rng, op, rng.choice(DTYPES), num_slots, max_rank, max_tokens)
    return ServingCase(family, layer, ranks, max_tokens, policy, graphs, steps, seed * 100_000 + index)


def schedule(rng: random.Random, family: str, num_slots: int, sizes: tuple[int, ...], policy: str, max_tokens: int,
             eager_only: bool = False) -> tuple[tuple[tuple[int, int], ...], tuple[ServingStep, ...], int]:
    """``(graphs, steps, pool)`` of a ``family`` sequence: the captures of every graph key (unless ``eager_only``),
    then the family's walk, over a pool of ``num_slots + 2`` adapters. Any layer's serving case draws its
    sequence here (the tensor-parallel ones too: ``conformance.tp.serving_cases``)."""
    builder = _Builder(rng, num_slots, num_slots + 2, sizes, policy, max_tokens, eager_only)
    if not eager_only:
        builder.capture_all()
    _walk(family, builder)
    return tuple(builder.graphs), tuple(builder.steps), builder.pool


def serving_cases(profile: str, seed: int) -> list[ServingCase]:
    if profile not in PROFILE_CASES:
        raise ValueError(f"no serving cases for profile {profile!r}: the profiles are {', '.join(PROFILE_CASES)}")
    return [serving_case(seed, index) for index in range(PROFILE_CASES[profile])]
