"""Edge-case families: the corners of the LoRA ops where implementations really break.

Each family is a goal the strategy steers towards (every case of family ``f`` exhibits feature ``f``
when the op can express it) and applies to the ops that read the knobs it needs. vLLM's own random
tests reach none of ``neg1``, ``neg1_one_slot``, ``last_slot``, ``unequal_seqs`` or ``slices``
(shared/notes/vllm-lora-ops.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.ops import OpSpec


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    needs_knobs: frozenset[str] = frozenset()
    feature: str | None = None  # the feature (conformance.cases.features) every case of the family shows
    dtypes: frozenset[str] | None = None  # the case dtypes where the family can show its feature (None: all)

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return self.needs_knobs <= spec.knobs and (self.dtypes is None or dtype in self.dtypes)


def _family(
    name: str, doc: str, needs: tuple[str, ...] = (), feature: str | None = "", dtypes: tuple[str, ...] | None = None
) -> Family:
    return Family(name, doc, frozenset(needs), name if feature == "" else feature, frozenset(dtypes) if dtypes else None)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family("random", "everything drawn freely", feature=None),
        _family("neg1", "rows without adapter (slot −1) mixed with adapter rows"),
        _family("neg1_one_slot", "slot −1 mixed with the only slot of a one-slot stack", feature="one_slot"),
        _family("allneg1", "no row uses an adapter"),
        _family("last_slot", "the last slot L−1 is used"),
        _family("noncontig", "one adapter on non-adjacent tokens"),
        _family("unequal_seqs", "sequences of unequal length, one of length 1", feature="len1_seq"),
        _family("t1", "a single token"),
        _family("large_t", "a thousand tokens or more"),
        _family("rank_padded", "adapters of rank below the stack's max rank"),
        _family("rank_odd", "ranks that are not multiples of 16, rank 1 included"),
        _family("rank_max", "the largest rank vLLM supports (256)", feature=None),
        _family("real_hidden", "hidden sizes of real models"),
        _family("odd_hidden", "hidden sizes that are no multiple of any block size"),
        _family("slices", "2–3 output slices of unequal width", ("slices",), "unequal_slices"),
        _family("offset", "output written from a column offset, output wider than written", ("offset",)),
        _family("wide_output", "output wider than the columns written", ("wide",)),
        _family("no_add_inputs", "add_inputs=False: overwrite instead of accumulate", ("add_inputs",)),
        _family("scaled", "scale ≠ 1", ("scale",)),
        _family(
            "fp32_input",
            "a float32 expand input (the shrink buffer) rounded to the weight dtype",
            ("expand_input",),
            dtypes=("float16", "bfloat16"),  # a float32 input into float32 weights rounds nothing
        ),
        _family("bias", "LoRA bias per slot", ("bias",)),
        _family("w4d", "4-D weight stacks [L, 1, rows, cols]"),
        _family("decode", "decode batch: one token per sequence", ("prefill",)),
        _family("positive", "all-positive values: large sums without cancellation"),
    )
}


def families_for(spec: OpSpec, dtype: str) -> tuple[Family, ...]:
    return tuple(f for f in FAMILIES.values() if f.applies_to(spec, dtype))
