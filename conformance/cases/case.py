"""A case: the complete, serializable description of one op invocation.

A case is data. Its structure (sequence lengths, slots, ranks, shapes, flags) is drawn by Hypothesis;
its values come from a seeded ``torch.Generator`` (``values.py``). Targets and the verdict never see
how it was drawn, only this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from conformance.query import case_id

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# Hidden sizes of real models (Llama, Mistral, Qwen, Gemma, Phi …) and sizes that are not a multiple
# of any kernel block (vLLM's test_punica_sizes list and the old CUDA "no suitable kernel" bugs).
REAL_HIDDEN_SIZES = (896, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 8192, 11008, 14336)
ODD_HIDDEN_SIZES = (7, 33, 127, 1000, 2049, 3424, 4097, 5121)
# The scale granularities of vLLM's fp8 LoRA kernels (Case.fp8_scales), in the order they test them last to first.
FP8_SCALES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str  # storage dtype of inputs and weights: float16 | bfloat16 | float32
    seq_lens: tuple[int, ...]  # tokens per sequence
    seq_slots: tuple[int, ...]  # adapter slot per sequence, −1 = no adapter
    num_slots: int  # L, slots in every stack (vLLM's max_loras)
    max_rank: int  # R, the stacks' rank dimension
    adapter_ranks: tuple[int, ...]  # true rank of each slot's adapter (≤ R, zero-padded above)
    hidden_size: int  # H, input features of shrink-side ops
    output_slices: tuple[int, ...]  # N_s, output width of each slice
    output_width: int  # W, columns of the output (≥ offset_start + Σ N_s)
    offset_start: int = 0  # first output column written (slice_offset of the *_slice ops)
    add_inputs: bool = True
    scale: float = 1.0
    expand_input_dtype: str | None = None  # dtype of the expand-side input; None = ``dtype``
    weights_4d: bool = False  # stacks as [L, 1, rows, cols] (vLLM layers) instead of [L, rows, cols]
    bias: bool = False
    is_prefill: bool = True
    distribution: str = "normal"  # normal | positive
    seed: int = 0
    family: str = "random"  # the edge-case family it was drawn for
    # Mixture-of-experts routing (the fused-MoE ops only; docs/moe.md). ``hidden_size`` is then the
    # input features K of the op (H for w13, I for w2) and every slice has the same width.
    num_experts: int = 0  # E, local experts in the stacks; 0 = not an MoE case
    top_k: int = 0  # choices per token
    topk_ids: tuple[tuple[int, ...], ...] = ()  # per token, the global expert of each choice
    expert_map: tuple[int, ...] = ()  # global expert → local expert or −1 (expert parallelism); () = all local
    disabled_slots: tuple[int, ...] = ()  # slots whose adapter_enabled (MoE) / module_enabled (full linear) is 0
    shared_experts: bool = False  # w13's A / w2's B with expert dim 1 (shared-expert LoRA)
    routed_weight: bool = False  # mul_routed_weight: x has T·top_k rows, the delta is weighted
    zero_weight_pairs: tuple[int, ...] = ()  # pairs t·top_k + k whose routing weight is exactly 0
    block_size: int = 0  # the kernels' block size (fused_moe_lora, moe_lora_align_block_size)
    naive_blocks: bool = False  # fused_moe_lora fed topk_ids.flatten() instead of sorted ids
    # The row layout of the segments (the sgmv ops only; the "segments" knob). Sequence ``b`` is
    # segment ``b`` of the metadata, rows ``[seq_starts[b], seq_starts[b] + seq_lens[b])``; a row no
    # segment covers is never written. The defaults are the canonical layout: back to back from row 0.
    seq_starts: tuple[int, ...] = ()  # first row of each segment, in metadata order; () = canonical
    num_rows: int = 0  # rows of the input and the output; 0 = sum(seq_lens)
    # The fp8 ops (lora_shrink_fp8, lora_expand_fp8; the "fp8_scales" knob): e4m3fn codes dequantized by
    # scales per tensor (one weight scale per slot), per token and output channel, or per block of
    # group_k contraction × group_n output features. "" = not an fp8 case.
    fp8_scales: str = ""  # "" | tensor | channel | block
    group_k: int = 0  # block scales only: the contraction elements one scale covers
    group_n: int = 0  # block scales only: the output features one scale covers
    # vLLM 0.34 (docs/vllm-lora-ops.md §10). Left out of the JSON when default, like the fields above.
    logits_per_seq: tuple[int, ...] = ()  # logits rows per sequence (spec decode: 1 + its draft tokens); () = one each
    absent_slices: tuple[tuple[int, int], ...] = ()  # (slot, slice): the adapter lacks that packed sub-module (zeros)
    repeated_slices: tuple[int, ...] = ()  # per slice, the sub-module whose weights it holds (Gemma 4: 0, 1, 1); () = its own
    embed_scale: float = 0.0  # the embedding's embed_scale folded into LoRA-B (scaled_embedding_lora); 0 = none

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if len(self.seq_lens) != len(self.seq_slots):
            problems.append(f"{len(self.seq_lens)} seq_lens but {len(self.seq_slots)} seq_slots")
        if any(n < 1 for n in self.seq_lens):
            problems.append(f"seq_lens must be ≥ 1, got {self.seq_lens}")
        if any(not -1 <= s < self.num_slots for s in self.seq_slots):
            problems.append(f"seq_slots {self.seq_slots} outside [-1, {self.num_slots - 1}]")
        if len(self.adapter_ranks) != self.num_slots or any(not 1 <= r <= self.max_rank for r in self.adapter_ranks):
            problems.append(f"adapter_ranks {self.adapter_ranks} must hold {self.num_slots} ranks in [1, {self.max_rank}]")
        if self.offset_start + sum(self.output_slices) > self.output_width:
            problems.append(
                f"offset_start {self.offset_start} + slices {self.output_slices} exceed output_width {self.output_width}"
            )
        if self.expand_input_dtype not in (None, *DTYPES):
            problems.append(f"expand_input_dtype {self.expand_input_dtype!r} is not a dtype name")
        if self.distribution not in ("normal", "positive"):
            problems.append(f"distribution {self.distribution!r} is not normal or positive")
        if any(not 0 <= s < self.num_slots for s in self.disabled_slots):
            problems.append(f"disabled_slots {self.disabled_slots} outside [0, {self.num_slots - 1}]")
        if self.num_experts or self.top_k or self.topk_ids:
            problems += self._routing_problems()
        if self.seq_starts or self.num_rows:
            problems += self._layout_problems()
        if self.fp8_scales or self.group_k or self.group_n:
            problems += self._fp8_problems()
        if self.logits_per_seq or self.absent_slices or self.repeated_slices or self.embed_scale:
            problems += self._v034_problems()
        if problems:
            raise ValueError("invalid case: " + "; ".join(problems))

    def _routing_problems(self) -> list[str]:
        problems = []
        if self.num_experts < 1 or self.top_k < 1:
            problems.append(f"an MoE case needs num_experts ≥ 1 and top_k ≥ 1, got {self.num_experts} and {self.top_k}")
        if len(self.topk_ids) != self.num_tokens or any(len(ids) != self.top_k for ids in self.topk_ids):
            problems.append(f"topk_ids must hold {self.top_k} experts for each of the {self.num_tokens} tokens")
        if any(not 0 <= e < self.global_experts for ids in self.topk_ids for e in ids):
            problems.append(f"topk_ids {self.topk_ids} outside [0, {self.global_experts - 1}]")
        if self.expert_map:
            local = sorted(e for e in self.expert_map if e != -1)
            if local != list(range(self.num_experts)):
                problems.append(f"expert_map {self.expert_map} must map onto each of the {self.num_experts} local experts once")
        if any(not 0 <= p < self.num_tokens * self.top_k for p in self.zero_weight_pairs):
            problems.append(f"zero_weight_pairs {self.zero_weight_pairs} outside the {self.num_tokens * self.top_k} pairs")
        if len(set(self.output_slices)) > 1:
            problems.append(f"MoE slices have equal widths, got {self.output_slices}")
        return problems

    def _layout_problems(self) -> list[str]:
        if self.num_rows < 0:
            return [f"num_rows must be ≥ 0 (0 = sum(seq_lens)), got {self.num_rows}"]
        if self.seq_starts and len(self.seq_starts) != len(self.seq_lens):
            count = f"{len(self.seq_starts)} seq_starts but {len(self.seq_lens)} seq_lens"
            return [f"{count}: give one start per segment, or () for back to back"]
        problems = []
        rows = self.num_tokens
        segments = sorted(zip(self.segment_starts, self.seq_lens))
        if any(start < 0 or start + n > rows for start, n in segments):
            problems.append(f"seq_starts {self.seq_starts} with seq_lens {self.seq_lens} reach outside the {rows} rows (num_rows)")
        if any(start < previous + n for (previous, n), (start, _) in zip(segments, segments[1:])):
            layout = f"seq_starts {self.seq_starts} with seq_lens {self.seq_lens}"
            problems.append(f"segments overlap: {layout}; each row belongs to one segment at most")
        return problems

    def _fp8_problems(self) -> list[str]:
        if self.fp8_scales not in FP8_SCALES:
            return [f"fp8_scales {self.fp8_scales!r} is not one of {', '.join(FP8_SCALES)}"]
        block = self.fp8_scales == "block"
        if block != (self.group_k > 0 and self.group_n > 0) or (not block and (self.group_k or self.group_n)):
            return [f"group_k and group_n ({self.group_k}, {self.group_n}) must both be > 0 for block scales and 0 otherwise"]
        return []

    def _v034_problems(self) -> list[str]:
        problems = []
        if self.logits_per_seq and (len(self.logits_per_seq) != len(self.seq_lens) or min(self.logits_per_seq) < 1):
            problems.append(f"logits_per_seq {self.logits_per_seq} must give ≥ 1 logits row for each of the {len(self.seq_lens)} sequences")
        if any(not (0 <= slot < self.num_slots and 0 <= s < self.num_slices) for slot, s in self.absent_slices):
            problems.append(f"absent_slices {self.absent_slices} name a (slot, slice) outside the {self.num_slots} slots × {self.num_slices} slices")
        if self.repeated_slices:
            if len(self.repeated_slices) != self.num_slices or any(not 0 <= j <= s for s, j in enumerate(self.repeated_slices)):
                problems.append(f"repeated_slices {self.repeated_slices} must name, for each of the {self.num_slices} slices, itself or an earlier slice")
            elif any(self.output_slices[s] != self.output_slices[j] for s, j in enumerate(self.repeated_slices)):
                problems.append(f"a repeated slice is as wide as the one it repeats: repeated_slices {self.repeated_slices}, widths {self.output_slices}")
        if self.embed_scale < 0:
            problems.append(f"embed_scale must be > 0 (or 0: none), got {self.embed_scale}")
        return problems

    # -- derived structure -------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def expand_input_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.expand_input_dtype or self.dtype]

    @property
    def num_tokens(self) -> int:
        """Rows of the input and the output: the tokens, plus any row no segment covers."""
        return self.num_rows or sum(self.seq_lens)

    @property
    def segment_starts(self) -> tuple[int, ...]:
        """The first row of each segment, in metadata order (canonical: exclusive prefix sum of the lengths)."""
        if self.seq_starts:
            return self.seq_starts
        return tuple(sum(self.seq_lens[:b]) for b in range(len(self.seq_lens)))

    @property
    def canonical_segments(self) -> bool:
        """Whether the segments lie back to back from row 0 in metadata order and cover every row."""
        starts = self.segment_starts
        return starts == tuple(sum(self.seq_lens[:b]) for b in range(len(starts))) and self.num_tokens == sum(self.seq_lens)

    @property
    def token_slots(self) -> tuple[int, ...]:
        """The slot of every row; −1 for a row of slot −1 and for a row no segment covers."""
        if not (self.seq_starts or self.num_rows):
            return tuple(slot for slot, n in zip(self.seq_slots, self.seq_lens) for _ in range(n))
        slots = [-1] * self.num_tokens
        for start, n, slot in zip(self.segment_starts, self.seq_lens, self.seq_slots):
            slots[start : start + n] = [slot] * n
        return tuple(slots)

    @property
    def covered_rows(self) -> tuple[bool, ...]:
        """Per row, whether a segment covers it (every row in the canonical layout)."""
        covered = [False] * self.num_tokens
        for start, n in zip(self.segment_starts, self.seq_lens):
            covered[start : start + n] = [True] * n
        return tuple(covered)

    @property
    def sampled_slots(self) -> tuple[int, ...]:
        """The slot of each logits row: one per sequence (its last token), or under speculative decoding
        (``logits_per_seq``) 1 + its draft tokens, every row of a sequence with its adapter (vLLM 0.34's
        ``LoraState.make_lora_inputs``: ``lora_ids.repeat(num_logits)``)."""
        if not self.logits_per_seq:
            return self.seq_slots
        return tuple(slot for slot, n in zip(self.seq_slots, self.logits_per_seq) for _ in range(n))

    @property
    def num_slices(self) -> int:
        return len(self.output_slices)

    @property
    def cost(self) -> int:
        """How big the case is, to pick small ones first: tokens × the wider of hidden size and output width ×
        rank × slices (a size, not a FLOP count)."""
        return self.num_tokens * max(self.hidden_size, self.output_width) * self.max_rank * self.num_slices

    # -- routing (MoE cases) -------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def global_experts(self) -> int:
        """Experts the router chooses from: all ranks' (``len(expert_map)``) or the local ones."""
        return len(self.expert_map) if self.expert_map else self.num_experts

    def local_expert(self, global_expert: int) -> int:
        """The local expert a global one maps to, −1 when it lives on another rank."""
        return self.expert_map[global_expert] if self.expert_map else global_expert

    def serves(self, slot: int, expert: int | None = None) -> bool:
        """Whether a row of ``slot`` (an MoE pair of ``slot`` and global ``expert``) is served: its slot is not −1
        and not disabled (``adapter_enabled`` / ``module_enabled`` 0), and the pair's expert is local."""
        return slot != -1 and slot not in self.disabled_slots and (expert is None or self.local_expert(expert) != -1)

    @property
    def pair_slots(self) -> tuple[int, ...]:
        """The slot of every (token, choice) pair ``t·top_k + k``: the token's slot."""
        return tuple(slot for slot in self.token_slots for _ in range(self.top_k))

    @cached_property
    def case_id(self) -> str:
        """The id (``conformance.query``): op, dtype, slices, rank, (experts and top_k,) family; a profile
        appends ``;draw=N`` to the second and later draws of the same id."""
        return case_id("op", self.op, {
            "dtype": SHORT_DTYPE[self.dtype], "slices": self.num_slices, "rank": self.max_rank,
            "experts": self.num_experts or None, "top_k": self.top_k if self.is_moe else None, "family": self.family,
        })

    # -- serialization -----------------------------------------------------------------------

    def to_json(self) -> dict:
        # The segment layout (and the fp8 fields) are left out when default, so that every case drawn before they existed
        # keeps its JSON (replays, cached profiles, digests) byte for byte.
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _LEFT_OUT_WHEN_DEFAULT or getattr(self, f.name) != f.default
        }

    @classmethod
    def from_json(cls, data: dict) -> Case:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown case field(s) {unknown}; a case has {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ValueError(f"case is missing field(s) {missing}")
        fields = {k: _tuples(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)


_LEFT_OUT_WHEN_DEFAULT = frozenset({
    "seq_starts", "num_rows", "fp8_scales", "group_k", "group_n", "logits_per_seq", "absent_slices", "repeated_slices", "embed_scale",
})  # fmt: skip


def _tuples(value: list) -> tuple:
    """JSON lists back to (nested) tuples: ``topk_ids`` is a tuple of tuples."""
    return tuple(_tuples(v) if isinstance(v, list) else v for v in value)
