"""One tensor-parallel LoRA case as data: which layer, how it is sharded, over how many ranks, on what batch.

A case is the *unsharded* problem (the full stacks, the full activations, the full output) plus how vLLM
would split it across ``tp_size`` ranks (``layer`` and ``fully_sharded``); the values are drawn from
``seed`` (``conformance.tp.values``), so a case travels as this small record (JSON, the results, the
replay of a failure by its test id); the referee draws its tensors from it and hands them to every rank.

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
from conformance.query import case_id

LAYERS = ("column", "merged_column", "qkv", "row", "qkv_indexer")
"""vLLM's layer kinds: ``ColumnParallelLinearWithLoRA`` (one slice), ``MergedColumnParallelLinearWithLoRA``
(two slices, gate/up), ``MergedQKVParallelLinearWithLoRA`` (three slices q/k/v, k and v of equal width),
``RowParallelLinearWithLoRA``; each also in its fully sharded ``*WithShardedLoRA`` form. And vLLM 0.33's
``Step5FusedQKVIndexerWithLoRA`` (``vllm/lora/layers/custom_layer.py``): seven slices q, k, v,
index_q, index_k, index_z, gate in one ``add_lora_linear`` call, never fully sharded."""

SLICES_OF_LAYER = {"column": 1, "merged_column": 2, "qkv": 3, "row": 1, "qkv_indexer": 7}
SLICE_NAMES = {"qkv": ("q", "k", "v"), "qkv_indexer": ("q", "k", "v", "index_q", "index_k", "index_z", "gate")}
FULLY_SHARDED_LAYERS = ("column", "merged_column", "qkv", "row")  # vLLM refuses fully_sharded_loras for Step5's layer
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
    index_kv_replicas: int = 1  # QKV + indexer only: ranks sharing each indexer k/z head (Step5's index_kv_head_replicas)

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
        if self.layer in SLICE_NAMES and len(self.output_slices) == SLICES_OF_LAYER[self.layer] and self.output_slices[1] != self.output_slices[2]:
            problems.append(f"output_slices {self.output_slices}: k and v have the same width in a QKV layer")
        if self.layer == "qkv_indexer" and len(self.output_slices) == 7 and self.output_slices[4] != self.output_slices[5]:
            problems.append(f"output_slices {self.output_slices}: index_k and index_z have the same width (one indexer kv head each)")
        if self.fully_sharded and self.layer not in FULLY_SHARDED_LAYERS:
            problems.append(f"a {self.layer} layer has no fully sharded form (vLLM 0.33 refuses fully_sharded_loras for it)")
        for name, value, allowed in (("kv_replicas", self.kv_replicas, ("qkv", "qkv_indexer")),
                                     ("index_kv_replicas", self.index_kv_replicas, ("qkv_indexer",))):
            if not isinstance(value, int) or value < 1:
                return problems + [f"{name} must be an integer >= 1, got {value!r}"]
            if value > 1 and (self.layer not in allowed or self.tp_size % value):
                which = "only a QKV layer replicates kv heads" if name == "kv_replicas" else "only a QKV + indexer layer replicates indexer heads"
                return problems + [f"{name} {value}: {which}, over a tp_size ({self.tp_size}) it divides"]
        for name, value, parts, replicas in self._divided_widths():
            if value < parts or value % parts:
                what = f"tp_size {parts}" if parts == self.tp_size else f"tp_size / {replicas} = {parts}"
                problems.append(f"{name} = {value} must be a positive multiple of {what} (vLLM divides it across the ranks)")
        return problems

    def _divided_widths(self) -> list[tuple[str, int, int, str]]:
        """The widths this layer splits across the ranks (named as the case's fields), into how many parts, and
        the replica field that makes the parts fewer than the ranks."""
        if self.layer == "row":
            widths = [("hidden_size", self.hidden_size, self.tp_size, "")]
            return widths + ([("output_slices[0]", self.output_slices[0], self.tp_size, "")] if self.fully_sharded else [])
        replica_field = ("", "kv_replicas", "kv_replicas", "kv_replicas", "index_kv_replicas", "index_kv_replicas", "")
        widths = [(f"output_slices[{s}]", n, parts, replica_field[s]) for s, (n, parts) in enumerate(zip(self.output_slices, self.slice_shards))]
        return widths + ([("max_rank", self.max_rank, self.tp_size, "")] if self.fully_sharded else [])

    # -- derived ------------------------------------------------------------------------------

    @property
    def op(self) -> str:
        """The report's op: one per layer kind (sharding and TP size are features)."""
        return f"tp_{self.layer}_parallel"

    @property
    def num_slices(self) -> int:
        return len(self.output_slices)

    @property
    def slice_replicas(self) -> tuple[int, ...]:
        """How many ranks hold the same shard of each output slice: 1, but ``kv_replicas`` for k and v of a QKV
        layer whose kv heads are replicated (vLLM's ``MergedQKVParallelLinearWithLoRA``), and in the QKV +
        indexer layer also for index_q (Step5 aligns the indexer's provider groups with the kv heads) and
        ``index_kv_replicas`` for index_k and index_z (``Step5FusedQKVIndexerWithLoRA.slice_lora_b``)."""
        if self.layer == "qkv":
            return (1, self.kv_replicas, self.kv_replicas)
        if self.layer == "qkv_indexer":
            kv, index_kv = self.kv_replicas, self.index_kv_replicas
            return (1, kv, kv, kv, index_kv, index_kv, 1)
        return (1,) * self.num_slices

    @property
    def slice_shards(self) -> tuple[int, ...]:
        """Into how many shards each output slice is cut: ``tp_size / slice_replicas``."""
        return tuple(self.tp_size // replicas for replicas in self.slice_replicas)

    def shard_of(self, s: int, rank: int) -> int:
        """Which shard of slice ``s`` ``rank`` holds: its rank, or for a replicated slice ``rank // replicas``
        (vLLM's ``kv_shard_id``: ranks 0 and 1 share kv head 0 when two ranks share each head)."""
        return rank // self.slice_replicas[s]

    @property
    def replica_groups(self) -> int:
        """How many copies of the gathered output the ranks hold: the most ranks any slice's shard is shared by
        (each copy is judged: group ``j`` takes a replicated shard from the rank ``r`` with ``r % replicas == j % replicas``)."""
        return max(self.slice_replicas)

    def slice_name(self, s: int) -> str:
        return SLICE_NAMES[self.layer][s] if self.layer in SLICE_NAMES else f"slice {s}"

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
        return case_id("layer", self.layer, {
            "tp": self.tp_size, "dtype": SHORT_DTYPE[self.dtype], "fully_sharded": self.fully_sharded,
            "kv_replicas": self.kv_replicas if self.kv_replicas > 1 else None,
            "index_kv_replicas": self.index_kv_replicas if self.index_kv_replicas > 1 else None, "family": self.family,
        })

    def features(self) -> frozenset[str]:
        """Names the expectations and the report match on: the TP size, the sharding, and the batch's rows."""
        return batch_features(self, {
            "fully_sharded": self.fully_sharded,
            "kv_replicated": self.replica_groups > 1,
            "many_slices": self.num_slices >= 4,
        })

    # -- serialization -------------------------------------------------------------------------

    def to_json(self) -> dict:
        return case_to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> TPCase:
        """The case ``to_json`` wrote; a missing, unknown or mistyped field raises ``ValueError`` naming it."""
        return case_from_json(cls, data, _FIELD_TYPES, "tensor-parallel case")


_FIELD_TYPES = {
    "layer": str, "fully_sharded": bool, "tp_size": int, "dtype": str, "seq_lens": "ints", "seq_slots": "ints",
    "num_slots": int, "max_rank": int, "hidden_size": int, "output_slices": "ints", "scale": float,
    "is_prefill": bool, "seed": int, "family": str, "kv_replicas": int, "index_kv_replicas": int,
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


_DERIVED = ("op", "output_width")  # written for readers of results.json (the report's clusters read these names)


def batch_features(case, own: dict[str, bool]) -> frozenset[str]:
    """A tensor-parallel case's features (:class:`TPCase`, ``MoETPCase``): its TP size, the rows of its batch
    (``neg1``, ``allneg1``, ``last_slot``), decode or prefill, and the kind's ``own`` features that hold."""
    used = {s for s in case.seq_slots if s != -1}
    found = {
        f"tp{case.tp_size}": True,
        **own,
        "neg1": -1 in case.seq_slots and bool(used),
        "allneg1": not used,
        "last_slot": case.num_slots - 1 in used,
        "decode": not case.is_prefill,
        "prefill": case.is_prefill,
    }
    return frozenset(name for name, present in found.items() if present)


def case_to_json(case) -> dict:
    """A tensor-parallel case record (``TPCase``, ``MoETPCase``) as JSON: its fields and the derived ``op``, ``output_width``."""
    return {**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)}, **{name: getattr(case, name) for name in _DERIVED}}


def case_from_json(cls, data, field_types: dict, what: str):
    """The ``cls`` record ``case_to_json`` wrote; a missing, unknown or mistyped field raises ``ValueError`` naming it,
    and so does a derived field that the other fields contradict."""
    if not isinstance(data, dict):
        raise ValueError(f"a {what} is a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    derived = set(_DERIVED)
    unknown = sorted(set(data) - set(fields) - derived)
    if unknown:
        raise ValueError(f"unknown {what} field(s) {unknown}; a case has {sorted(fields)}")
    missing = sorted(name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in data)
    if missing:
        raise ValueError(f"{what} is missing field(s) {missing}")
    case = cls(**{name: _field_value(name, value, field_types[name]) for name, value in data.items() if name not in derived})
    written = case_to_json(case)
    for name in derived & set(data):
        if data[name] != written[name]:
            raise ValueError(f"field {name!r} is {data[name]!r}, but the case's other fields make it {written[name]!r}")
    return case
