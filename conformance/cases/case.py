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

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# Hidden sizes of real models (Llama, Mistral, Qwen, Gemma, Phi …) and sizes that are not a multiple
# of any kernel block (vLLM's test_punica_sizes list and the old CUDA "no suitable kernel" bugs).
REAL_HIDDEN_SIZES = (896, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 8192, 11008, 14336)
ODD_HIDDEN_SIZES = (7, 33, 127, 1000, 2049, 3424, 4097, 5121)


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

    # -- derived structure -------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def expand_input_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.expand_input_dtype or self.dtype]

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def token_slots(self) -> tuple[int, ...]:
        return tuple(slot for slot, n in zip(self.seq_slots, self.seq_lens) for _ in range(n))

    @property
    def sampled_slots(self) -> tuple[int, ...]:
        """One sampled row per sequence (its last token), as the logits op sees them."""
        return self.seq_slots

    @property
    def num_slices(self) -> int:
        return len(self.output_slices)

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

    @property
    def pair_slots(self) -> tuple[int, ...]:
        """The slot of every (token, choice) pair ``t·top_k + k``: the token's slot."""
        return tuple(slot for slot in self.token_slots for _ in range(self.top_k))

    @cached_property
    def case_id(self) -> str:
        """A readable id: op, dtype, slices, rank, (experts and top_k,) family (the index is appended by the profile)."""
        routing = f"-e{self.num_experts}k{self.top_k}" if self.is_moe else ""
        return f"{self.op}-{SHORT_DTYPE[self.dtype]}-slices{self.num_slices}-r{self.max_rank}{routing}-{self.family}"

    # -- serialization -----------------------------------------------------------------------

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

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


def _tuples(value: list) -> tuple:
    """JSON lists back to (nested) tuples: ``topk_ids`` is a tuple of tuples."""
    return tuple(_tuples(v) if isinstance(v, list) else v for v in value)
