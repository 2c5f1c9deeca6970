"""One tensor-parallel LoRA case as data: which layer, how it is sharded, over how many ranks, on what batch.

A case is the *unsharded* problem (the full stacks, the full activations, the full output) plus how vLLM
would split it across ``tp_size`` ranks (``layer`` and ``fully_sharded``); the values are drawn from
``seed`` (``conformance.tp.values``), so a case travels as this small record (JSON, the results, the
replay of a failure by its test id) and every rank rebuilds the same tensors from it.

Every width that vLLM divides by the tensor-parallel size (the output slices of the column layers, the
input features of the row layers, the rank of fully sharded column layers, the output of fully sharded
row layers) must be divisible by ``tp_size``: a case that is not is refused when it is made, naming the
field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from conformance.cases.case import DTYPES, SHORT_DTYPE

LAYERS = ("column", "merged_column", "qkv", "row")
"""vLLM's layer kinds: ``ColumnParallelLinearWithLoRA`` (one slice), ``MergedColumnParallelLinearWithLoRA``
(two slices, gate/up), ``MergedQKVParallelLinearWithLoRA`` (three slices q/k/v, k and v of equal width),
``RowParallelLinearWithLoRA``; each also in its fully sharded ``*WithShardedLoRA`` form."""

SLICES_OF_LAYER = {"column": 1, "merged_column": 2, "qkv": 3, "row": 1}
TP_SIZES = (2, 4)


@dataclass(frozen=True)
class TPCase:
    layer: str  # column | merged_column | qkv | row
    fully_sharded: bool  # vLLM's fully_sharded_loras (the *WithShardedLoRA layers, S-LoRA)
    tp_size: int  # ranks, one process each
    dtype: str  # float16 | bfloat16 | float32: activations, stacks and output
    seq_lens: tuple[int, ...]  # tokens per sequence
    seq_slots: tuple[int, ...]  # slot per sequence, −1 = no adapter
    num_slots: int  # L, slots in every stack
    max_rank: int  # R, the stacks' rank dimension
    hidden_size: int  # H, input features of the (unsharded) layer
    output_slices: tuple[int, ...]  # N_s, output width of each (unsharded) slice
    scale: float = 1.0
    is_prefill: bool = True
    seed: int = 0
    family: str = "random"  # what the case was drawn for (the report's family column)
    kv_replicas: int = 1  # QKV only: ranks sharing each kv head (vLLM's num_kv_head_replicas, when tp > kv heads)

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError(f"invalid tensor-parallel case: {'; '.join(problems)}")

    def _problems(self) -> list[str]:
        problems = []
        if self.layer not in LAYERS:
            return [f"layer {self.layer!r} is not one of {', '.join(LAYERS)}"]
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.tp_size, int) or self.tp_size < 2:
            return problems + [f"tp_size must be an integer >= 2, got {self.tp_size!r}"]
        if len(self.seq_lens) != len(self.seq_slots) or not self.seq_lens or min(self.seq_lens) < 1:
            problems.append(f"seq_lens {self.seq_lens} and seq_slots {self.seq_slots} must be equally long, non-empty, each length >= 1")
        if self.num_slots < 1 or not all(-1 <= s < self.num_slots for s in self.seq_slots):
            problems.append(f"seq_slots {self.seq_slots} must lie in [-1, num_slots) with num_slots {self.num_slots} >= 1")
        if len(self.output_slices) != SLICES_OF_LAYER[self.layer]:
            problems.append(f"output_slices {self.output_slices}: a {self.layer} layer has {SLICES_OF_LAYER[self.layer]} slice(s)")
        if self.layer == "qkv" and len(self.output_slices) == 3 and self.output_slices[1] != self.output_slices[2]:
            problems.append(f"output_slices {self.output_slices}: k and v have the same width in a QKV layer")
        if not isinstance(self.kv_replicas, int) or self.kv_replicas < 1:
            return problems + [f"kv_replicas must be an integer >= 1, got {self.kv_replicas!r}"]
        if self.kv_replicas > 1 and (self.layer != "qkv" or self.tp_size % self.kv_replicas):
            problems.append(f"kv_replicas {self.kv_replicas}: only a QKV layer replicates kv heads, over a tp_size "
                            f"({self.tp_size}) it divides")
            return problems
        for name, value, parts in self._divided_widths():
            if value < parts or value % parts:
                what = f"tp_size {parts}" if parts == self.tp_size else f"tp_size / kv_replicas = {parts}"
                problems.append(f"{name} = {value} must be a positive multiple of {what} (vLLM divides it across the ranks)")
        return problems

    def _divided_widths(self) -> list[tuple[str, int, int]]:
        """The widths this layer splits across the ranks (named as the case's fields), and into how many parts."""
        if self.layer == "row":
            widths = [("hidden_size", self.hidden_size, self.tp_size)]
            return widths + ([("output_slices[0]", self.output_slices[0], self.tp_size)] if self.fully_sharded else [])
        widths = [(f"output_slices[{s}]", n, parts) for s, (n, parts) in enumerate(zip(self.output_slices, self.slice_shards))]
        return widths + ([("max_rank", self.max_rank, self.tp_size)] if self.fully_sharded else [])

    # -- derived ------------------------------------------------------------------------------

    @property
    def op(self) -> str:
        """The report's op: one per layer kind (sharding and TP size are features)."""
        return f"tp_{self.layer}_parallel"

    @property
    def num_slices(self) -> int:
        return len(self.output_slices)

    @property
    def slice_shards(self) -> tuple[int, ...]:
        """Into how many shards each output slice is cut: ``tp_size``, but ``tp_size / kv_replicas`` for k and v
        of a QKV layer whose kv heads are replicated (vLLM's ``MergedQKVParallelLinearWithLoRA``)."""
        if self.kv_replicas == 1:
            return (self.tp_size,) * self.num_slices
        return (self.tp_size, self.tp_size // self.kv_replicas, self.tp_size // self.kv_replicas)

    def shard_of(self, s: int, rank: int) -> int:
        """Which shard of slice ``s`` ``rank`` holds: its rank, or for replicated k and v its ``kv_shard_id``
        (``rank // kv_replicas``: ranks 0 and 1 share kv head 0 when two ranks share each head)."""
        return rank if self.slice_shards[s] == self.tp_size else rank // self.kv_replicas

    @property
    def output_width(self) -> int:
        return sum(self.output_slices)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def token_slots(self) -> tuple[int, ...]:
        return tuple(slot for slot, length in zip(self.seq_slots, self.seq_lens) for _ in range(length))

    @property
    def sampled_slots(self) -> tuple[int, ...]:
        return self.seq_slots

    @cached_property
    def case_id(self) -> str:
        sharding = "-fully_sharded" if self.fully_sharded else ""
        replicated = f"-kv_replicas{self.kv_replicas}" if self.kv_replicas > 1 else ""
        return f"tp{self.tp_size}-{self.layer}{sharding}{replicated}-{SHORT_DTYPE[self.dtype]}-{self.family}"

    def features(self) -> frozenset[str]:
        """Names the expectations and the report match on: the TP size, the sharding, and the batch's rows."""
        used = {s for s in self.seq_slots if s != -1}
        found = {
            f"tp{self.tp_size}": True,
            "fully_sharded": self.fully_sharded,
            "kv_replicated": self.kv_replicas > 1,
            "neg1": -1 in self.seq_slots and bool(used),
            "allneg1": not used,
            "last_slot": self.num_slots - 1 in used,
            "decode": not self.is_prefill,
            "prefill": self.is_prefill,
        }
        return frozenset(name for name, present in found.items() if present)

    # -- serialization -------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "op": self.op,  # derived, for readers of results.json (the report's clusters read these names)
            "output_width": self.output_width,
        }

    @classmethod
    def from_json(cls, data: dict) -> TPCase:
        """The case ``to_json`` wrote; a missing, unknown or mistyped field raises ``ValueError`` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"a tensor-parallel case is a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        derived = {"op", "output_width"}
        unknown = sorted(set(data) - set(fields) - derived)
        if unknown:
            raise ValueError(f"unknown tensor-parallel case field(s) {unknown}; a case has {sorted(fields)}")
        missing = sorted(name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in data)
        if missing:
            raise ValueError(f"tensor-parallel case is missing field(s) {missing}")
        values = {}
        for name, value in data.items():
            if name in derived:
                continue
            values[name] = _field_value(name, value, _FIELD_TYPES[name])
        case = cls(**values)
        for name in derived & set(data):
            if data[name] != case.to_json()[name]:
                raise ValueError(f"field {name!r} is {data[name]!r}, but the case's other fields make it {case.to_json()[name]!r}")
        return case


_FIELD_TYPES = {
    "layer": str, "fully_sharded": bool, "tp_size": int, "dtype": str, "seq_lens": "ints", "seq_slots": "ints",
    "num_slots": int, "max_rank": int, "hidden_size": int, "output_slices": "ints", "scale": float,
    "is_prefill": bool, "seed": int, "family": str, "kv_replicas": int,
}


def _field_value(name: str, value, kind):
    """``value`` as field ``name`` holds it, or ``ValueError`` naming the field and what it got."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if kind == "ints":
        if not isinstance(value, (list, tuple)) or not all(is_int(v) for v in value):
            raise ValueError(f"field {name!r} must be a list of integers, got {value!r}")
        return tuple(value)
    if kind is float and (is_int(value) or isinstance(value, float)):
        return float(value)
    if kind is int and is_int(value):
        return value
    if kind in (bool, str) and isinstance(value, kind):
        return value
    raise ValueError(f"field {name!r} must be {kind.__name__}, got {value!r}")
