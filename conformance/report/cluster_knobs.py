"""What the cases varied that a group of failures depends on: the knob values of a failure cluster's signature.

Kind, rows and op family (``conformance.report.clusters``) do not tell every two bugs apart: an expand
that ignores ``offset_start`` and one that, with ``add_inputs=False``, rewrites columns it must leave alone
both write outside their region on adapter rows. What does tell them apart is what their failing cases
varied: the one fails only where ``offset_start > 0``, the other only with ``add_inputs=False``. This
module reads that off the results, passing ones included, and never from a fixed list of suspects.

**A knob value belongs to a group's signature** (:meth:`KnobValues.conditions`) when, among the cases of
the group's ops that vary the knob (cases of one op showing two values or more), the group's failures
are confined to that value, passing cases show another value, and the confinement is unlikely to be
chance: with ``p`` the share of those ops' cases that have the value and ``n`` the failures, ``pⁿ ≤
CHANCE``. A knob with more than two values (the dtype) may hold a set of them: "dtype float16 or
bfloat16". A knob the failures do not depend on shows every value among them and stays out, so one
cause over many knob values stays one group; a group of one failure never has a condition (``p`` would
have to be below ``CHANCE``).

**A group may hold several causes** (:meth:`KnobValues.split`): it is split when two or three conditions
(on different knobs, among the most over-represented knob values of its failures) cover its failures and
each explains failures of its own, those that no other of them covers, with its own chance test among
the cases no other covers; a condition another group of the family depends on (a knob besides the
dtype) needs no new evidence. A failure two of them cover goes to the one its op fails most often with,
then to the one with the most failures of its own. The cover with the fewest conditions wins, then the
least likely by chance, then the first in sorted order: the result does not depend on the order of the
results.

**One cause can show in several ways** (:meth:`KnobValues.explains`, applied by ``clusters``): ignoring
``offset_start`` mostly writes outside the region and sometimes only leaves the region unwritten; a
rewrite of the whole output hits rows without adapter, columns beyond the slice, or the slices an earlier
call wrote. A group joins the largest group of the same op family before it (larger, ties by signature)
whose conditions name a knob other than the dtype (a dtype alone is what numerical bugs share without
sharing a cause) when every failure of the group has that group's knob values, or when the group
depends on knob values besides the dtype that the larger one depends on too (a rank tail dropped writes
nothing where ``add_inputs=True`` and too little otherwise: both only with a rank no multiple of 16).
The larger group's signature stays; its members keep what they showed (``hits``).

**Every split or join is tried** whether or not a group has conditions already: writing outside the
slice needs columns beyond it whichever bug does it, so two such bugs share "columns beyond the written
ones" and still split by what else they depend on.

The knobs read here (:data:`KNOB_VALUES`) are the case knobs of ``conformance.cases.knobs`` in the values
that change a kernel's path (``offset_start > 0`` or not, one slice or several, not the widths
themselves), the dtype, and two rank patterns (a rank no multiple of 16, an adapter rank below the
stack's). Slot patterns are not: where the rows hit (rows without adapter, the last slot) is already
the signature's. End-to-end cases have none of these fields and take no part.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import combinations

from conformance.verdict import Outcome

# How unlikely by chance a confinement must be to count: about twenty knobs are tested per group, so a
# false condition turns up about once in fifty groups whose failures do not depend on any knob.
CHANCE = 1e-3
MOST_CONDITIONS_IN_A_SPLIT = 3
MOST_CANDIDATES = 12  # the most over-represented knob values a split tries (12 choose 3 = 220 covers at most)

Condition = tuple[str, tuple]  # (knob, the values the failures are confined to), values sorted by str


@dataclass(frozen=True)
class KnobValue:
    """One thing a case varies, as the value a result's case shows (None: the case does not say)."""

    name: str
    read: Callable[[dict, dict], object]  # (record, case) → value
    words: Callable[[object], str]  # one value in words
    label: str = ""  # said once before the values: "dtype float16 or bfloat16"


def _field(name: str, convert: Callable = lambda value: value) -> Callable[[dict, dict], object]:
    return lambda record, case: convert(case[name]) if name in case else None


def _said(true: str, false: str) -> Callable[[object], str]:
    return lambda value: true if value else false


def _beyond_written(record: dict, case: dict) -> bool | None:
    if "output_width" not in case or "output_slices" not in case:
        return None
    return case["output_width"] > (case.get("offset_start") or 0) + sum(case["output_slices"])


def _rank_padded(record: dict, case: dict) -> bool | None:
    ranks, max_rank = case.get("adapter_ranks"), case.get("max_rank")
    return None if not ranks or max_rank is None else min(ranks) < max_rank


def _left_out(name: str, convert: Callable) -> Callable[[dict, dict], object]:
    """A field a case's JSON leaves out at its default (``Case.to_json``): a case of an op reads it as the default
    (falsy) when absent; None only for a record with no op case."""
    return lambda record, case: convert(case.get(name)) if "op" in case else None


def _packed(record: dict, case: dict) -> bool | None:
    return bool(case.get("absent_slices") or case.get("repeated_slices")) if "op" in case else None


def _segments_moved(record: dict, case: dict) -> bool | None:
    if "seq_starts" not in case and "num_rows" not in case:
        return None
    return bool(case.get("seq_starts")) or bool(case.get("num_rows"))


KNOB_VALUES: tuple[KnobValue, ...] = (
    KnobValue("dtype", lambda record, case: record.get("dtype"), str, label="dtype"),
    KnobValue("add_inputs", _field("add_inputs", bool), lambda value: f"add_inputs={value}"),
    KnobValue("offset", _field("offset_start", lambda start: start > 0), _said("offset_start > 0", "offset_start = 0")),
    KnobValue("slices", _field("output_slices", lambda widths: len(widths) > 1), _said("several output slices", "one output slice")),
    KnobValue("wide", _beyond_written, _said("columns beyond the written ones", "no columns beyond the written ones")),
    KnobValue("scale", _field("scale", lambda scale: scale != 1), _said("scale ≠ 1", "scale = 1")),
    KnobValue("expand_input", _field("expand_input_dtype", lambda dtype: dtype == "float32"),
              _said("a float32 expand input", "an expand input in the case's dtype")),
    KnobValue("bias", _field("bias", bool), _said("a LoRA bias", "no LoRA bias")),
    KnobValue("w4d", _field("weights_4d", bool), _said("4-D weight stacks", "3-D weight stacks")),
    KnobValue("prefill", _field("is_prefill", bool), _said("prefill batches", "decode batches")),
    KnobValue("segments", _segments_moved, _said("sgmv segments not back to back", "back-to-back sgmv segments")),
    KnobValue("module_enabled", _field("disabled_slots", bool), _said("a disabled slot", "every slot enabled")),
    KnobValue("rank_odd", _field("max_rank", lambda rank: rank % 16 != 0), _said("a rank no multiple of 16", "a rank multiple of 16")),
    KnobValue("rank_padded", _rank_padded, _said("an adapter rank below the stack's", "adapter ranks equal to the stack's")),
    KnobValue("routed_weight", _field("routed_weight", bool), _said("mul_routed_weight", "no routed weight")),
    KnobValue("naive", _field("naive_blocks", bool), _said("naive block assignment", "block-aligned assignment")),
    KnobValue("shared_experts", _field("shared_experts", bool), _said("shared-expert stacks", "per-expert stacks")),
    KnobValue("expert_map", _field("expert_map", bool), _said("an expert_map", "every expert local")),
    KnobValue("fp8_scales", _field("fp8_scales"), lambda value: f"fp8 {value} scales" if value else "no fp8"),
    # vLLM 0.34's knobs: fields left out of a case's JSON at their default, so a case without one shows the default
    KnobValue("spec_decode", _left_out("logits_per_seq", bool), _said("1 + draft logits rows per request", "one logits row per request")),
    KnobValue("packed", _packed, _said("an adapter lacking or repeating a packed sub-module", "every slice its own sub-module")),
    KnobValue("embed_scale", _left_out("embed_scale", bool), _said("an embed_scale folded into LoRA-B", "no embed_scale")),
)  # fmt: skip
_BY_NAME = {knob.name: knob for knob in KNOB_VALUES}
_ORDER = {knob.name: i for i, knob in enumerate(KNOB_VALUES)}


def condition_text(condition: Condition) -> str:
    """``add_inputs=False``, ``dtype float16 or bfloat16``."""
    knob, values = condition
    said = " or ".join(_BY_NAME[knob].words(value) for value in values)
    return f"{_BY_NAME[knob].label} {said}" if _BY_NAME[knob].label else said


@dataclass
class KnobValues:
    """The judged op cases of a run (passes and the failures the gate rejects), with their knob values."""

    results: Iterable[dict]
    failing: set[str] = field(default_factory=set)
    values: dict[str, dict[str, object]] = field(init=False, default_factory=dict)  # case id → knob → value
    cases_of: dict[str, list[str]] = field(init=False, default_factory=dict)  # op → case ids
    op_of: dict[str, str] = field(init=False, default_factory=dict)  # case id → op
    passed: set[str] = field(init=False, default_factory=set)
    varying: dict[str, set[str]] = field(init=False, default_factory=dict)  # knob → ops whose cases show two values or more
    _chances: dict[tuple, float | None] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        seen: dict[tuple[str, str], set] = {}
        for record in self.results:
            judged = record.get("outcome") == Outcome.PASS.value or record["id"] in self.failing
            if record.get("level") == "model" or not judged or not isinstance(record.get("case"), dict):
                continue
            case = record["case"]
            shown = {knob.name: knob.read(record, case) for knob in KNOB_VALUES}
            self.values[record["id"]] = {name: value for name, value in shown.items() if value is not None}
            self.cases_of.setdefault(record["op"], []).append(record["id"])
            self.op_of[record["id"]] = record["op"]
            if record["outcome"] == Outcome.PASS.value:
                self.passed.add(record["id"])
            for name, value in self.values[record["id"]].items():
                seen.setdefault((name, record["op"]), set()).add(value)
        for (name, op), values in seen.items():
            if len(values) > 1:
                self.varying.setdefault(name, set()).add(op)

    # -- one group -------------------------------------------------------------------------

    def _value(self, record: dict, knob: str) -> object:
        """The value of ``knob`` the record's case shows (its op's fixed value where the op does not vary it)."""
        return self.values.get(record["id"], {}).get(knob)

    def _varies(self, record_or_op: dict | str, knob: str) -> bool:
        op = record_or_op if isinstance(record_or_op, str) else record_or_op["op"]
        return op in self.varying.get(knob, ())

    def _has(self, record: dict, condition: Condition) -> bool:
        value = self._value(record, condition[0])
        return value is not None and value in condition[1]

    def _chance(self, knob: str, values: tuple, count: int, ops: set[str], excluded: list[Condition] = ()) -> float | None:
        """How likely ``count`` failures of ``ops`` all have one of ``values`` by chance, among those ops' cases
        that none of ``excluded`` covers; None where no passing case there shows another value."""
        key = (knob, values, count, tuple(sorted(ops)), tuple(excluded))
        if key not in self._chances:
            self._chances[key] = self._chance_uncached(knob, values, count, ops, excluded)
        return self._chances[key]

    def _chance_uncached(self, knob: str, values: tuple, count: int, ops: set[str], excluded: list[Condition]) -> float | None:
        cases = [c for op in sorted(ops) if self._varies(op, knob) for c in self.cases_of.get(op, ())
                 if knob in self.values[c] and not any(self.values[c].get(k) in v for k, v in excluded)]  # fmt: skip
        inside = {c for c in cases if self.values[c].get(knob) in values}
        if not cases or not any(c in self.passed and c not in inside for c in cases):
            return None
        return (len(inside) / len(cases)) ** count

    def conditions(self, members: list[dict]) -> tuple[Condition, ...]:
        """The knob values ``members`` are confined to, by the rule of the module docstring."""
        found = []
        for knob in KNOB_VALUES:
            # every failure's value counts (a shrink failing with its fixed add_inputs=True rules out
            # "only with add_inputs=False"); only the ops that vary the knob are evidence
            values = tuple(sorted({self._value(m, knob.name) for m in members} - {None}, key=str))
            varying = [m for m in members if self._varies(m, knob.name) and self._value(m, knob.name) is not None]
            if not varying:
                continue
            chance = self._chance(knob.name, values, len(varying), {m["op"] for m in varying})
            if chance is not None and chance <= CHANCE:
                found.append((knob.name, values))
        return tuple(found)

    # -- several causes in one group ---------------------------------------------------------

    def _candidates(self, members: list[dict]) -> list[Condition]:
        """Knob values more frequent among ``members`` than among their ops' cases, most over-represented first:
        what a cause could be."""
        candidates = []
        for knob in KNOB_VALUES:
            ops = {m["op"] for m in members} & self.varying.get(knob.name, set())
            cases = [c for op in sorted(ops) for c in self.cases_of.get(op, ()) if knob.name in self.values[c]]
            shown = [value for m in members if m["op"] in ops and (value := self._value(m, knob.name)) is not None]
            everything = sorted({self.values[c][knob.name] for c in cases}, key=str)
            choices = [(value,) for value in everything]
            if len(everything) > 2:  # all but one value: "dtype float16 or bfloat16"
                choices += [tuple(v for v in everything if v != left_out) for left_out in everything]
            for values in choices:
                among_members = sum(value in values for value in shown)
                among_cases = sum(self.values[c].get(knob.name) in values for c in cases)
                if among_members and among_members * len(cases) > among_cases * len(shown):
                    lift = among_members * len(cases) / (among_cases * len(shown))
                    candidates.append((-lift, _ORDER[knob.name], [str(v) for v in values], (knob.name, values)))
        return [condition for *_, condition in sorted(candidates)[:MOST_CANDIDATES]]

    def _cover(self, members: list[dict], conditions: tuple[Condition, ...], established: frozenset[Condition],
               having: dict[Condition, frozenset[int]], rates: dict) -> tuple[float, list[list[dict]]] | None:
        """Each condition's failures, where ``conditions`` split ``members`` (module docstring), with how likely
        that is by chance (its log); None where they do not split them. ``having``: the members (by position)
        with each condition."""
        if len(frozenset().union(*(having[c] for c in conditions))) < len(members):
            return None
        covering = [[c for c in conditions if i in having[c]] for i in range(len(members))]
        own = [[m for m, found in zip(members, covering) if found == [c]] for c in conditions]
        evidence = 0.0
        for condition, alone in zip(conditions, own):
            if not alone:
                return None
            if condition in established:  # another group's failures showed it: no new evidence needed
                continue
            others = [c for c in conditions if c != condition]
            chance = self._chance(*condition, len(alone), {m["op"] for m in alone}, others)
            if chance is None or chance > CHANCE:
                return None
            evidence += math.log(chance) if chance > 0 else -math.inf
        # a failure two conditions cover goes to the one its op fails most often with (with add_inputs=False an
        # op may fail every time, in float16 seldom: the float16 cases of the op mostly pass), then to the one
        # with the most failures of its own
        rank = {c: (-len(alone), i) for i, (c, alone) in enumerate(zip(conditions, own))}
        parts: list[list[dict]] = [[] for _ in conditions]
        for member, found in zip(members, covering):
            best = min(found, key=lambda c: (-self._failure_rate(member["op"], c, members, rates), rank[c]))
            parts[conditions.index(best)].append(member)
        return evidence, parts

    def _failure_rate(self, op: str, condition: Condition, members: list[dict], rates: dict) -> float:
        """The share of ``op``'s cases with ``condition`` that are among ``members`` (kept in ``rates``)."""
        if (op, condition) not in rates:
            knob, values = condition
            cases = [c for c in self.cases_of.get(op, ()) if self.values[c].get(knob) in values]
            failing = {m["id"] for m in members if m["op"] == op}
            rates[op, condition] = sum(c in failing for c in cases) / len(cases) if cases else 0.0
        return rates[op, condition]

    def split(self, members: list[dict], established: frozenset[Condition] = frozenset()
              ) -> list[tuple[list[dict], tuple[Condition, ...]]]:
        """``members`` as one or more causes, each with its conditions (module docstring). ``established``:
        conditions other groups' failures showed, which a split may use without new evidence."""
        own = self.conditions(members)
        if len(members) < 2:
            return [(members, own)]
        # tried even where the group has knob values: writing outside the slice needs columns beyond it
        # whichever of two bugs does it, so "columns beyond the written ones" is every such group's
        having = {c: frozenset(i for i, m in enumerate(members) if self._has(m, c))
                  for c in {*self._candidates(members), *established}}
        candidates = sorted((c for c in having if having[c]), key=lambda c: (_ORDER[c[0]], [str(v) for v in c[1]]))
        rates: dict = {}
        for size in range(2, MOST_CONDITIONS_IN_A_SPLIT + 1):
            covers = []
            for chosen in combinations(candidates, size):
                if len({knob for knob, _ in chosen}) == size and (found := self._cover(members, chosen, established, having, rates)):
                    covers.append((found[0], [_ORDER[k] for k, _ in chosen], chosen, found[1]))
            if covers:
                *_, chosen, parts = min(covers, key=lambda cover: cover[:2])
                return [(part, self._with(self.conditions(part), condition)) for part, condition in zip(parts, chosen)]
        return [(members, own)]

    def _with(self, found: tuple[Condition, ...], condition: Condition) -> tuple[Condition, ...]:
        """``found``, and ``condition`` where ``found`` says nothing of its knob (the split established it)."""
        if any(knob == condition[0] for knob, _ in found):
            return found
        return tuple(sorted((*found, condition), key=lambda c: _ORDER[c[0]]))

    # -- one cause shown in several ways -------------------------------------------------------

    def explains(self, conditions: tuple[Condition, ...], members: list[dict], their_conditions: tuple[Condition, ...]) -> bool:
        """Whether a group with ``conditions`` is the cause of ``members`` (whose own are ``their_conditions``):
        it depends on a knob besides the dtype, and every one of ``members`` has its knob values, or they
        depend on the same knob values besides the dtype (it also on others: a rank tail dropped writes
        nothing with ``add_inputs=True`` and too little with either)."""
        if not any(knob != "dtype" for knob, _ in conditions):
            return False
        besides_dtype = {c for c in their_conditions if c[0] != "dtype"}
        return all(self._has(m, c) for m in members for c in conditions) or bool(besides_dtype) and besides_dtype <= set(conditions)
