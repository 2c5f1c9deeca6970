"""One tensor-parallel MoE LoRA case as data: the w13 (gate/up) or the w2 (down) LoRA of vLLM's
``FusedMoEWithLoRA`` split over ``tp_size`` ranks, with the per-rank intermediate size padded or not.

Like :class:`conformance.tp.case.TPCase`, a case is the *unsharded* problem plus how vLLM splits it;
its values come from ``seed`` (``conformance.tp.moe_layer.moe_tensors``). The expert intermediate
size ``I`` is split into ``tp_size`` shards of ``I / tp_size`` rows (vLLM 0.33's
``intermediate_size_per_partition_unpadded``); a backend that pads the per-rank size up to a multiple
of ``alignment`` allocates ``padded_shard`` rows per rank (``intermediate_size_per_partition``), and
the rows past the shard are zeros. ``alignment`` 1 is the unpadded layer.

Only the plain (not fully sharded) MoE LoRA is a case: fully sharded, vLLM runs the collective between
shrink and expand *inside* ``fused_moe_lora`` (docs/tensor-parallel.md), which the suite's
hardware-neutral ``add_lora_w13`` / ``add_lora_w2`` have no place for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from conformance.cases.case import DTYPES, SHORT_DTYPE
from conformance.query import case_id

from .case import batch_features, case_from_json, case_to_json

MOE_LAYERS = ("moe_w13", "moe_w2")
"""``moe_w13``: the gate/up LoRA (``add_lora_w13``, gate and up as two slices of ``I``, or one fused
slice of ``2·I`` for ``FusedMoE3DWithLoRA``); ``moe_w2``: the down LoRA (``add_lora_w2``)."""

MOE_WRAPPER_METHODS = ("add_lora_w13", "add_lora_w2")


@dataclass(frozen=True)
class MoETPCase:
    layer: str  # moe_w13 | moe_w2
    tp_size: int  # ranks, one process each
    dtype: str  # float16 | bfloat16 | float32
    seq_lens: tuple[int, ...]  # tokens per sequence
    seq_slots: tuple[int, ...]  # slot per sequence, −1 = no adapter
    num_slots: int  # L
    max_rank: int  # R
    hidden_size: int  # H: w13's input, w2's output
    intermediate_size: int  # I: the experts' (unsharded, unpadded) intermediate size
    num_experts: int  # E, every expert local (no expert parallelism)
    top_k: int  # choices per token
    alignment: int = 1  # each rank's I / tp rows padded up to a multiple of this (1: no padding)
    fused_w13: bool = False  # w13 only: gate and up as one 2·I slice (FusedMoE3DWithLoRA)
    disabled_slots: tuple[int, ...] = ()  # slots whose adapter_enabled is 0
    is_prefill: bool = True
    seed: int = 0
    family: str = "random"

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError(f"invalid tensor-parallel MoE case: {'; '.join(problems)}")

    def _problems(self) -> list[str]:
        if self.layer not in MOE_LAYERS:
            return [f"layer {self.layer!r} is not one of {', '.join(MOE_LAYERS)}"]
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.tp_size, int) or self.tp_size < 2:
            return problems + [f"tp_size must be an integer >= 2, got {self.tp_size!r}"]
        if len(self.seq_lens) != len(self.seq_slots) or not self.seq_lens or min(self.seq_lens) < 1:
            problems.append(f"seq_lens {self.seq_lens} and seq_slots {self.seq_slots} must be equally long, non-empty, each length >= 1")
        if self.num_slots < 1 or not all(-1 <= s < self.num_slots for s in self.seq_slots):
            problems.append(f"seq_slots {self.seq_slots} must lie in [-1, num_slots) with num_slots {self.num_slots} >= 1")
        if not all(0 <= s < self.num_slots for s in self.disabled_slots):
            problems.append(f"disabled_slots {self.disabled_slots} must lie in [0, num_slots)")
        if self.intermediate_size < self.tp_size or self.intermediate_size % self.tp_size:
            problems.append(f"intermediate_size = {self.intermediate_size} must be a positive multiple of tp_size {self.tp_size} "
                            "(vLLM divides the experts' intermediate size across the ranks)")
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k {self.top_k} must lie in [1, num_experts = {self.num_experts}]")
        if self.alignment < 1:
            problems.append(f"alignment must be >= 1, got {self.alignment}")
        if self.fused_w13 and self.layer != "moe_w13":
            problems.append("fused_w13: only the w13 LoRA has gate and up to fuse")
        return problems

    # -- derived ------------------------------------------------------------------------------

    @property
    def op(self) -> str:
        return f"tp_{self.layer}"

    @property
    def fully_sharded(self) -> bool:
        return False  # see the module docstring

    @property
    def shard(self) -> int:
        """``I / tp``: the intermediate rows of the base weight each rank holds (vLLM 0.33: the unpadded size)."""
        return self.intermediate_size // self.tp_size

    @property
    def padded_shard(self) -> int:
        """The rows each rank allocates: the shard rounded up to a multiple of ``alignment``."""
        return -(-self.shard // self.alignment) * self.alignment

    @property
    def padding(self) -> int:
        return self.padded_shard - self.shard

    @property
    def num_slices(self) -> int:
        """Slices handed to the wrapper: gate and up (2), or one fused w13 slice, or w2's one."""
        return 2 if self.layer == "moe_w13" and not self.fused_w13 else 1

    @property
    def output_width(self) -> int:
        """Columns of the unsharded output: ``2·I`` (gate | up) for w13, ``H`` for w2."""
        return 2 * self.intermediate_size if self.layer == "moe_w13" else self.hidden_size

    @property
    def judged_width(self) -> int:
        """The output as judged: the unsharded columns, then every rank's padding columns (w13 only; they
        must come back untouched)."""
        return self.output_width + (2 * self.padding * self.tp_size if self.layer == "moe_w13" else 0)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def token_slots(self) -> tuple[int, ...]:
        return tuple(slot for slot, length in zip(self.seq_slots, self.seq_lens) for _ in range(length))

    @property
    def sampled_slots(self) -> tuple[int, ...]:
        return self.seq_slots

    @property
    def pair_slots(self) -> tuple[int, ...]:
        """The slot of each output row: one row per (token, choice) pair, ``t·top_k + k``."""
        return tuple(slot for slot in self.token_slots for _ in range(self.top_k))

    @cached_property
    def case_id(self) -> str:
        return case_id("layer", self.layer, {
            "tp": self.tp_size, "dtype": SHORT_DTYPE[self.dtype], "fused": self.fused_w13 or None,
            "padded": self.alignment if self.padding else None, "family": self.family,
        })

    def features(self) -> frozenset[str]:
        used = {s for s in self.seq_slots if s != -1}
        return batch_features(self, {
            "moe_tp": True,
            "padded_intermediate": self.padding > 0,
            "moe_fused_slice": self.fused_w13,
            "moe_disabled": bool(used & set(self.disabled_slots)),
        })

    # -- serialization -------------------------------------------------------------------------

    def to_json(self) -> dict:
        return case_to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> MoETPCase:
        """The case ``to_json`` wrote; a missing, unknown or mistyped field raises ``ValueError`` naming it."""
        return case_from_json(cls, data, _FIELD_TYPES, "tensor-parallel MoE case")


_FIELD_TYPES = {
    "layer": str, "tp_size": int, "dtype": str, "seq_lens": "ints", "seq_slots": "ints", "num_slots": int, "max_rank": int,
    "hidden_size": int, "intermediate_size": int, "num_experts": int, "top_k": int, "alignment": int, "fused_w13": bool,
    "disabled_slots": "ints", "is_prefill": bool, "seed": int, "family": str,
}
