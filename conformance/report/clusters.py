"""Failures grouped into clusters, one per distinct problem, so a report says "1 distinct problem" and not
"733 failures".

A backend with one bug fails every case that reaches it: rows without adapter that receive the last
slot's delta fail every kernel and wrapper op, in every dtype, hundreds of cases with hundreds of
messages. A cluster gathers failures (outcomes the gate rejects: fail, broken, unexpected pass) by a
**signature** read from the structured fields of each result, never from its message text:

* **kind**: the most telling failure kind (``conformance.verdict.failure_kind``), or ``unexpected
  pass``;
* for a raise (kind ``raised``), **what raised and where**, from the result's ``raised`` (recorded in the
  target's process beside its traceback, ``conformance.text.raised_at``): the exception's type and the
  innermost frame of the target's code, file and function without the line (one bug raising at two lines
  of one function is one place), never a frame of the suite's own harness: "TypeError in
  my_backend/ops.py:HpuTarget.bgmv_shrink". So a ``TypeError`` in one op and an ``AssertionError`` in
  another are two clusters; a result without ``raised`` (an older suite's) says "the call";
* **where it hits**: which rows went wrong, from ``failing_slots`` (−1 = rows without adapter) against
  the slots the case uses and its slot count: rows without adapter, adapter rows, only the last slot's
  rows (the other slots' right), rows with and without adapter, columns outside the written region
  (adapter rows written outside their slice); which of several adapter slots fail is not told apart
  further: it is mostly which rows' error happened to exceed the budget; for kinds with no rows, what they concern (the call, the
  output tensor, an input); a result that carries ``where`` (the verdict's own description of the
  places it hit) uses that instead;
* **op family**: dense LoRA (the bgmv/sgmv/lora_shrink/lora_expand kernels and the dense wrapper
  methods) or MoE LoRA (fused_moe_lora, moe_lora_align_block_size, add_lora_w13/w2). The level is not
  part of the signature: a wrapper computes through the same Punica computation as its kernels (vLLM's
  wrappers call them), so a kernel bug fails the wrapper ops too, and splitting by level would count
  one bug twice. Each cluster lists its ops by level, so whether kernels, wrappers or both fail is
  still read off it;
* **the knob values it depends on** (``conformance.report.cluster_knobs``, whose docstring has the
  rule): a knob value is part of it when, among the cases of its ops that vary the knob, its failures
  are confined to that value beyond chance while passing cases show others ("only with
  add_inputs=False", "only with dtype bfloat16 or float16"); a knob the failures do not depend on
  stays out, so one cause over many knob values is one cluster. So the clustering reads the passing
  results too. After the failures are grouped by the parts above (and the consistent-with rule below),
  a group that several knob values cover, each with failures of its own, splits into one cluster each
  (two bugs that both write outside the slice, one only with ``offset_start > 0``, one only with
  ``add_inputs=False``); a group whose failures have the knob values another, larger group depends on
  (a knob besides the dtype), or that depends on the same ones, joins it whatever its kind and rows
  (one bug that writes outside the slice in some cases and nothing in others); a raise never joins
  another group nor is joined (what raised, and where, is its cause). The title names the knob values.

One case cannot always tell two descriptions apart, so a failure has its own signature (the most
precise thing it shows) and the other signatures it is **consistent with**, and it joins whichever of
them the most failures show as their own:

* a case whose only adapter slot is the last one is consistent with "the last slot's rows only", and
  one where only the last slot's rows fail with "adapter rows" (the others happened to stay within
  budget); "nothing written" in a case whose only adapter slot is the last is a last-slot bug's
  "exceeds the error budget" where there was nothing else to write; rows without adapter written
  besides adapter rows are consistent with "rows without adapter";
* an end-to-end failure (level ``model``) is a consequence of the ops the model runs: it joins the
  largest op cluster of its family whose rows are the kind of rows its failing requests are (requests
  without adapter ↔ rows without adapter, requests with an adapter ↔ adapter rows), counted under
  ``end_to_end``; one that no op cluster explains is a cluster of its own.

Which signature wins depends only on how many failures show each one, and the knob values only on the
cases' values and outcomes, not on the order of the results. Every cluster's kind, rows and family are
some failure's own signature (a group split off by knob values takes the one most of its failures
show; a joined group, the larger group's), and every member has its cluster's knob values. Each
cluster lists the signatures its members showed (``hits``), so a merged description stays visible.
Clusters are numbered by size, largest first (ties by signature). Each has its count, kinds, ops,
levels and dtypes, the knob values it depends on (``only_with`` in words, ``conditions`` knob →
values), and its **smallest case**: the one with the fewest tokens × widest of hidden size and output
width (then tokens, rank, slots), op cases before end-to-end ones, and a shrunk case (``--shrink``,
the result's ``shrunk``) where one is smaller, with its repro.

**A title is true of every member** (:func:`described`, :func:`cluster_title`): it names the cluster's
signature and, while an op member fits none named so far (neither its own signature nor one it is
consistent with: a failure joined by its knob values, of another kind or on other rows), the description
most such members show; ``described`` lists them. Descriptions with one predicate share it: "rows without
adapter or columns outside the written region are zeroed, or adapter rows exceed the error budget".
Elements written outside the region "are zeroed" where every member a description covers wrote zeros
there (the result's ``outside_zeroed``, from the values the referee compared), "are overwritten"
otherwise: a zeroed row and a delta added where none belongs are told apart. End-to-end members are
consequences of the op cluster they join (counted in ``end_to_end``), not described by its title.
"""

from __future__ import annotations

from collections import Counter

from conformance.ops.level import LEVEL_ORDER
from conformance.verdict import FailureKind, Outcome
from conformance.verdict.failure_kind import SEVERITY_ORDER

from .cluster_knobs import KnobValues, condition_text

DENSE, MOE = "dense LoRA", "MoE LoRA"
UNEXPECTED_PASS = Outcome.UNEXPECTED_PASS.value

# where it hits (op cases; end-to-end cases say "requests" for "rows")
# Which of a case's adapter slots fail is mostly incidental (the rows whose error happened to exceed
# the budget); two patterns are a bug's own: only rows without adapter, only the last slot's rows.
NO_ADAPTER = "rows without adapter"
BOTH_KINDS_OF_ROWS = "rows with and without adapter"
ADAPTER = "adapter rows"
LAST_SLOT = "adapter rows of the last slot (L−1) only"
OUTSIDE_COLUMNS = "columns outside the written region"
LATER_SLICES = " in slices after the first"  # where results say which slices: the first one right, the others not

# Between descriptions equally many failures show, the more specific bug class wins (the same choice
# from either side, so two groups that each could join the other do not swap places).
SPECIFIC = {NO_ADAPTER: 0, LAST_SLOT: 1, OUTSIDE_COLUMNS: 2, ADAPTER: 3, BOTH_KINDS_OF_ROWS: 4}


def _specificity(hit: str) -> tuple[int, int]:
    base = hit.removesuffix(LATER_SLICES)
    return SPECIFIC.get(base, len(SPECIFIC)), 0 if base != hit else 1  # a hit in later slices only: more specific

# which kind of row a hit is, for attributing end-to-end failures to an op cluster
NO_ADAPTER_ROWS, ADAPTER_ROWS, BOTH_ROWS = "no adapter", "adapter", "both"

# A kind whose failure is located by rows reads "<where> <verb>"; the others are a whole-call title. Elements
# written outside the region read "are zeroed" where every member's were all written zero (the result's
# ``outside_zeroed``), else "are overwritten".
ZEROED, OVERWRITTEN = "are zeroed", "are overwritten"
VERBS = {
    FailureKind.OUTSIDE_REGION.value: OVERWRITTEN,
    FailureKind.WROTE_NOTHING.value: "receive nothing (the output is unchanged where it must be written)",
    FailureKind.NUMERICS.value: "exceed the error budget",
    FailureKind.NAN_INF.value: "hold NaN/Inf",
    FailureKind.INVARIANT.value: "break an invariant",
    FailureKind.TOKENS.value: "generate other tokens",
    FailureKind.BASE_CHANGED.value: "change when LoRA is enabled (against the same engine with LoRA disabled)",
}
WHOLE_CALL = {  # kind → (where, title)
    FailureKind.WRONG_OUTPUT_TYPE.value: ("the output tensor", "the output changes shape or dtype"),
    FailureKind.MODIFIED_INPUT.value: ("an input tensor", "an input tensor is modified"),
    FailureKind.SYSTEMATIC.value: ("the LoRA delta", "the LoRA delta carries a systematic error"),
    FailureKind.PRECISION.value: ("the output", "the output has the precision of a coarser dtype"),
    FailureKind.STALE_STATE.value: ("the served steps", "served step after step, a batch reads state left by capture or an earlier step"),
    FailureKind.RAISED.value: ("the call", "the target raises"),  # with the result's ``raised``: its type and frame
    FailureKind.CRASHED.value: ("the call", "the process running the case crashes"),
    FailureKind.TIMED_OUT.value: ("the call", "the case hangs past its timeout"),
    FailureKind.MALFORMED_REPLY.value: ("the reply", "the target's process sends back what is not data the referee accepts"),
}


def is_clustered(record: dict) -> bool:
    """Whether a result is a failure the gate rejects (and so belongs to a cluster)."""
    try:
        return not Outcome(record.get("outcome")).accepted_by_gate
    except ValueError:  # an outcome this suite does not know (a hand-made document): not ours to group
        return False


def family(record: dict) -> str:
    """The op family: MoE LoRA or dense LoRA, from the case's own fields: an op case's experts, an end-to-end
    case's model (``is_moe``, derived and written with the case: ``conformance.e2e.cases``)."""
    case = record.get("case") or {}
    return MOE if case.get("num_experts") or case.get("is_moe") else DENSE


def _kind(record: dict) -> str:
    if record.get("outcome") == UNEXPECTED_PASS:
        return UNEXPECTED_PASS
    return record.get("kind") or (record.get("kinds") or [None])[0] or record.get("outcome") or "?"


def where(record: dict) -> str:
    """Where a failure hits, from ``failing_slots``, the kind and the case's slots (or the result's ``where``)."""
    if record.get("where"):
        return "; ".join(record["where"])
    kind = _kind(record)
    if kind == UNEXPECTED_PASS:
        return f"cases listed as {(record.get('expectation') or {}).get('id', 'a known failure')}"
    if kind == FailureKind.RAISED.value:
        return _raised_where(record)
    if kind in WHOLE_CALL:
        return WHOLE_CALL[kind][0]
    failing = set(record.get("failing_slots") or ())
    if record.get("level") == "model":
        return _requests(failing)
    if not failing:
        return "the output"
    case = record.get("case") or {}
    used = set(case.get("seq_slots") or ()) - {-1}
    adapter = failing - {-1}
    if -1 in failing:
        return BOTH_KINDS_OF_ROWS if adapter else NO_ADAPTER
    if kind == FailureKind.OUTSIDE_REGION.value:  # adapter rows only: it wrote columns it must leave alone
        return OUTSIDE_COLUMNS
    slots = case.get("num_slots") or 0
    if adapter == {slots - 1} and used > adapter:  # the other slots' rows are right
        return LAST_SLOT + _slices(record, exact=True)
    return ADAPTER + _slices(record, exact=True)


def _raised_where(record: dict) -> str:
    """What raised and where, from the result's ``raised`` (``conformance.text.raised_at``): ``TypeError in
    my_backend/ops.py:HpuTarget.bgmv_shrink``; "the call" for a result without it (an older suite's)."""
    raised = record.get("raised")
    if not isinstance(raised, dict) or not raised.get("type"):
        return WHOLE_CALL[FailureKind.RAISED.value][0]
    return f"{raised['type']} in {raised['frame']}" if raised.get("frame") else str(raised["type"])


def _later_slices_only(record: dict) -> tuple[bool, bool]:
    """Whether the first slice is right and some later ones wrong, and whether every later one is
    (from ``failing_slices``, where the result has them: −1 is a column outside every slice)."""
    failing = set(record.get("failing_slices") or ())
    slices = len((record.get("case") or {}).get("output_slices") or ())
    later = set(range(1, slices))
    some = slices >= 2 and bool(failing) and failing <= later
    return some, some and failing == later


def _slices(record: dict, exact: bool) -> str:
    """``LATER_SLICES`` where every later slice fails and the first does not (``exact``), or some of them."""
    some, every = _later_slices_only(record)
    return LATER_SLICES if (every if exact else some) else ""


def _requests(failing: set[int]) -> str:
    if not failing:
        return "requests"
    if failing == {-1}:
        return "requests without adapter"
    return "requests with and without adapter" if -1 in failing else "requests with an adapter"


def row_class(hit: str) -> str | None:
    """Which kind of row a hit is (``NO_ADAPTER_ROWS``, ``ADAPTER_ROWS``, ``BOTH_ROWS``), None when it has no rows."""
    hit = hit.removesuffix(LATER_SLICES)
    if hit in (NO_ADAPTER, "requests without adapter"):
        return NO_ADAPTER_ROWS
    if hit in (BOTH_KINDS_OF_ROWS, "requests with and without adapter"):
        return BOTH_ROWS
    if hit in (ADAPTER, LAST_SLOT, OUTSIDE_COLUMNS, "requests with an adapter"):
        return ADAPTER_ROWS
    return None


def signature(record: dict) -> tuple[str, str, str]:
    """``(kind, where, family)``: two failures with the same signature are one problem."""
    return _kind(record), where(record), family(record)


def title(kind: str, hit: str, zeroed: bool = False) -> str:
    """One description's line, e.g. "rows without adapter are overwritten" ("are zeroed" with ``zeroed``), "the
    target raises TypeError in ops.py:Hpu.bgmv_shrink"."""
    return _subject(kind, hit) + " " + _predicate(kind, zeroed) if kind in VERBS else _subject(kind, hit)


def _subject(kind: str, hit: str) -> str:
    """A whole-call title, or the rows a row-located kind's title names."""
    if kind == UNEXPECTED_PASS:
        return f"{hit} pass (unexpected pass)"
    if kind == FailureKind.RAISED.value and hit != WHOLE_CALL[kind][0]:
        return f"the target raises {hit}"
    if kind in WHOLE_CALL:
        return WHOLE_CALL[kind][1]
    return hit if kind in VERBS else f"{hit} fail ({kind})"


def _predicate(kind: str, zeroed: bool) -> str:
    return ZEROED if zeroed and kind == FailureKind.OUTSIDE_REGION.value else VERBS[kind]


def fits(record: dict, kind: str, hit: str, op_family: str) -> bool:
    """Whether the description ``(kind, hit)`` of ``op_family`` is true of the failure ``record``: it is the
    failure's own signature or one the failure is consistent with."""
    key = (kind, hit, op_family)
    return signature(record) == key or (record.get("level") != "model" and key in consistent_signatures(record))


def described(key: tuple, members: list[dict], own: dict) -> list[tuple[str, str]]:
    """The descriptions a cluster's title names, so that it is true of every op member: its signature's, then,
    while a member fits none named so far (one joined by its knob values, showing another kind or other rows),
    the own signature most such members show. End-to-end members are consequences, counted apart."""
    kind, hit, op_family = key[:3]
    parts = [(kind, hit)]
    unfit = [m for m in members if m.get("level") != "model" and not fits(m, kind, hit, op_family)]
    while unfit:
        shown = Counter(own[m["id"]][:2] for m in unfit)
        part = min(shown, key=lambda k: (-shown[k], _specificity(k[1]), k))
        parts.append(part)
        unfit = [m for m in unfit if not fits(m, *part, op_family)]
    return parts


def cluster_title(parts: list[tuple[str, str]], members: list[dict], op_family: str) -> str:
    """The title naming every description of ``parts``: those with one predicate share it ("rows without adapter
    or columns outside the written region are zeroed, or adapter rows exceed the error budget"). Elements
    written outside the region "are zeroed" where every member it describes wrote zeros there."""
    phrases: dict[str, list[str]] = {}
    for kind, hit in parts:
        if kind not in VERBS:
            phrases.setdefault(title(kind, hit), [])
            continue
        zeroed = all(m.get("outside_zeroed") for m in members if m.get("level") != "model" and fits(m, kind, hit, op_family))
        phrases.setdefault(_predicate(kind, zeroed), []).append(_subject(kind, hit))
    return ", or ".join(" or ".join(subjects) + " " + predicate if subjects else predicate for predicate, subjects in phrases.items())


def cluster_label(cluster: dict, total: int) -> str:
    """How a failure names its cluster in JUnit and Allure: ``cluster 1/3 "rows without adapter are overwritten"``."""
    return f'cluster {cluster["id"]}/{total} "{cluster["title"]}"'


def message_lead(record: dict) -> str:
    """How a failure's message begins (``conformance.plugin.report_outcome``, ``conformance.report.junit``):
    ``fail [numerics]``, ``fail [numerics] (flaky)``."""
    kinds = ", ".join(record.get("kinds") or ())
    lead = f"{record['outcome']} [{kinds}]" if kinds else record["outcome"]
    if record.get("stability") in ("flaky", "nondeterministic"):
        lead += f" ({record['stability']})"
    return lead


def label_message(text: str, record: dict, cluster: dict, total: int) -> str:
    """``text`` with the cluster named after its lead: ``fail [numerics] cluster 1/2 "…": …``; unchanged where
    the lead is not there (so a labelled text stays as it is: its lead is no longer followed by the colon)."""
    lead = message_lead(record) + ":"
    at = text.find(lead)
    if at < 0:
        return text
    at += len(lead) - 1
    return text[:at] + " " + cluster_label(cluster, total) + text[at:]


def _case_slots(record: dict) -> tuple[set[int], int]:
    """The adapter slots a case's rows use, and its slot count L."""
    case = record.get("case") or {}
    return set(case.get("seq_slots") or ()) - {-1}, case.get("num_slots") or 0


def consistent_signatures(record: dict) -> list[tuple[str, str, str]]:
    """The signatures an op case's failure is consistent with besides its own (see the module docstring)."""
    kind, hit, op_family = signature(record)
    used, slots = _case_slots(record)
    base = hit.removesuffix(LATER_SLICES)
    suffix = hit[len(base):]
    rows = [base]
    if base == LAST_SLOT:  # the other slots' rows stayed within budget this time
        rows.append(ADAPTER)
    if base == ADAPTER and used == {slots - 1}:  # the last slot is the only one: its bug, or every slot's
        rows.append(LAST_SLOT)
    if base == BOTH_KINDS_OF_ROWS and kind == FailureKind.OUTSIDE_REGION.value:  # adapter rows wrong besides
        rows.append(NO_ADAPTER)
    # the slices: the later ones all wrong may be incidental to a bug of every slice; only some of them wrong
    # may be a later-slices bug whose other later slices stayed within budget
    suffixes = [suffix, ""] if suffix else ["", LATER_SLICES] if _slices(record, exact=False) else [""]
    others = [(kind, row + ending, op_family) for row in rows for ending in suffixes]
    if kind == FailureKind.WROTE_NOTHING.value and base == ADAPTER and used == {slots - 1}:
        others.append((FailureKind.NUMERICS.value, LAST_SLOT, op_family))  # its missing delta was all there was to write
    return [key for key in others if key != (kind, hit, op_family)]


def cluster_failures(results: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """``(clusters, cluster id by case id)`` over the failures in ``results`` (the passing ones tell which knob
    values the failures depend on: ``conformance.report.cluster_knobs``)."""
    failing = sorted((r for r in results if is_clustered(r)), key=lambda r: r["id"])
    own = {r["id"]: signature(r) for r in failing}
    op_failures = [r for r in failing if r.get("level") != "model"]
    shown = Counter(own[r["id"]] for r in op_failures)  # how many op failures show each

    def chosen(record: dict) -> tuple:
        """The signature an op failure joins."""
        options = [own[record["id"]], *consistent_signatures(record)]
        return min(options, key=lambda k: (-shown.get(k, 0), _specificity(k[1]), k))

    by_signature: dict[tuple, list[dict]] = {}
    for record in op_failures:
        by_signature.setdefault(chosen(record), []).append(record)
    knobs = KnobValues(results, {r["id"] for r in failing})
    # what the groups that depend on a knob value show, each family's, a group of several causes may split by
    established: dict[str, set] = {}
    for key, members in by_signature.items():
        established.setdefault(key[2], set()).update(c for c in knobs.conditions(members) if c[0] != "dtype")
    causes = [
        (_shown_signature(key, part, own, shown), part, conditions)
        for key in sorted(by_signature)
        for part, conditions in knobs.split(by_signature[key], frozenset(established.get(key[2], ())))
    ]  # fmt: skip
    groups = _join_ways_of_one_cause(causes, knobs)

    # an end-to-end failure joins the largest op cluster of its family whose rows are its requests' kind
    explained: Counter = Counter()
    op_groups = {key: len(members) for key, members in groups.items()}
    for record in failing:
        if record.get("level") != "model":
            continue
        key = own[record["id"]]
        rows = row_class(key[1])
        explaining = [k for k in op_groups if rows is not None and k[2] == key[2] and row_class(k[1]) == rows]
        if explaining:
            key = min(explaining, key=lambda k: (-op_groups[k], k))
            explained[key] += 1
        else:
            key = (*key, ())
        groups.setdefault(key, []).append(record)
    ordered = sorted(groups, key=lambda key: (-len(groups[key]), key))
    clusters, membership = [], {}
    for number, key in enumerate(ordered, 1):
        members = groups[key]
        hits = Counter(own[m["id"]][1] for m in members)
        clusters.append(_describe(number, key, members, explained[key], hits, own))
        membership.update((record["id"], number) for record in members)
    return clusters, membership


def _shown_signature(key: tuple, part: list[dict], own: dict, shown: Counter) -> tuple:
    """``key`` where a failure of ``part`` shows it as its own, else the own signature most of its failures
    show (a part split off by knob values may lack the one its group joined)."""
    owned = {own[m["id"]] for m in part}
    if key in owned:
        return key
    return min(owned, key=lambda k: (-sum(own[m["id"]] == k for m in part), -shown[k], k))


def _join_ways_of_one_cause(causes: list[tuple[tuple, list[dict], tuple]], knobs: KnobValues) -> dict[tuple, list[dict]]:
    """Op failures by ``(kind, where, family, conditions)``: a group joins the largest group of its family
    before it (larger, ties by signature) that ``KnobValues.explains`` is its cause: one whose knob values (a
    knob besides the dtype) every failure of it has, or that depends on its knob values too."""
    order = sorted(range(len(causes)), key=lambda i: (-len(causes[i][1]), causes[i][0], causes[i][2]))
    target = {}
    for position, i in enumerate(order):
        key, members, conditions = causes[i]
        larger = [j for j in order[:position] if causes[j][0][2] == key[2] and _may_join(key, causes[j][0])
                  and knobs.explains(causes[j][2], members, conditions)]
        target[i] = larger[0] if larger else i  # the first in order is the largest

    def root(i: int) -> int:
        while target[i] != i:
            i = target[i]
        return i

    joined: dict[int, list[dict]] = {}
    for i in order:
        joined.setdefault(root(i), []).extend(causes[i][1])
    groups: dict[tuple, list[dict]] = {}
    for i, members in joined.items():
        key, own_members, conditions = causes[i]
        if len(members) > len(own_members):  # the knob values every failure joined has
            conditions = knobs.conditions(members)
        groups.setdefault((*key, conditions), []).extend(members)  # two parts that came to one description: one
    return {key: sorted(members, key=lambda r: r["id"]) for key, members in groups.items()}


def _may_join(key: tuple, larger: tuple) -> bool:
    """Whether a group may join a larger one by knob values: never a raise, nor into one (what raised, and
    where, is the cause: ``TypeError`` in one function and ``AssertionError`` in another are two)."""
    return FailureKind.RAISED.value not in (key[0], larger[0])


def _describe(number: int, key: tuple, members: list[dict], end_to_end: int, hits: Counter, own: dict) -> dict:
    kind, hit, op_family, conditions = key
    parts = described(key, members, own)
    levels = Counter(m.get("level") or "other" for m in members)
    level_rank = {level: i for i, level in enumerate(LEVEL_ORDER)}
    ops = Counter(m["op"] for m in members)
    op_level = {m["op"]: m.get("level") or "other" for m in members}
    kinds = {k for m in members for k in m.get("kinds") or ()}
    return {
        "id": number,
        "title": cluster_title(parts, members, op_family) + (f" (only with {'; '.join(map(condition_text, conditions))})" if conditions else ""),
        "described": [{"kind": part_kind, "where": part_hit} for part_kind, part_hit in parts],  # what its title names
        "kind": kind,
        "where": hit,
        "family": op_family,
        "only_with": [condition_text(c) for c in conditions],  # the knob values its failures depend on
        "conditions": {knob: list(values) for knob, values in conditions},
        "count": len(members),
        "hits": {hit: hits[hit] for hit in sorted(hits, key=lambda h: (-hits[h], h))},  # what its members showed themselves
        "end_to_end": end_to_end,  # end-to-end failures this op cluster explains
        "outcomes": dict(sorted(Counter(m["outcome"] for m in members).items())),
        "kinds": [k.value for k in SEVERITY_ORDER if k.value in kinds],
        "levels": {lv: levels[lv] for lv in sorted(levels, key=lambda lv: (level_rank.get(lv, len(level_rank)), lv))},
        "ops": {op: ops[op] for op in sorted(ops, key=lambda op: (level_rank.get(op_level[op], len(level_rank)), op))},
        "dtypes": dict(sorted(Counter(m.get("dtype") or "?" for m in members).items())),
        "smallest": smallest_case(members),
    }


def _size(record: dict, case: dict) -> tuple:
    """Smaller is easier to read: op cases first, then fewest tokens × widest shape, tokens, rank, slots."""
    if record.get("level") == "model":
        requests = case.get("requests") or ()
        return (1, len(requests), sum(len(r.get("prompt") or "") for r in requests), 0, 0)
    tokens = sum(case.get("seq_lens") or ())
    width = max(case.get("hidden_size") or 0, case.get("output_width") or 0, 1)
    return (0, tokens * width, tokens, case.get("max_rank") or 0, case.get("num_slots") or 0)


def _shape(record: dict, case: dict) -> str:
    """What a kernel author reads first about a case: how many tokens, slots, how wide."""
    if record.get("level") == "model":
        return f"{len(case.get('requests') or ())} requests, {case.get('max_loras')} LoRA slots"
    seqs = case.get("seq_lens") or ()
    parts = [_count(len(seqs), "sequence"), _count(sum(seqs), "token"), _count(case.get("num_slots") or 0, "slot"),
             f"rank {case.get('max_rank')}", f"hidden {case.get('hidden_size')}", f"slices {list(case.get('output_slices') or ())}"]
    if case.get("num_experts"):
        parts.append(f"{case['num_experts']} experts, top-{case.get('top_k')}")
    return ", ".join(parts)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def smallest_case(members: list[dict]) -> dict | None:
    """The member (or a member's shrunk case) that is smallest, with its repro; None without members."""
    candidates = []
    for record in members:
        case = record.get("case") or {}
        candidates.append((_size(record, case), 1, record["id"], {
            "id": record["id"], "op": record["op"], "dtype": record.get("dtype"), "shape": _shape(record, case),
            "repro": (record.get("repro") or "").splitlines()[0] if record.get("repro") else None,
            "replay": record.get("replay"), "shrunk": False,
        }))  # fmt: skip
        shrunk = record.get("shrunk")
        if shrunk and shrunk.get("case"):
            candidates.append((_size(record, shrunk["case"]), 0, record["id"], {
                "id": record["id"], "op": record["op"], "dtype": record.get("dtype"), "shape": _shape(record, shrunk["case"]),
                "repro": shrunk.get("repro"), "replay": shrunk.get("replay"), "shrunk": True,
            }))  # fmt: skip
    return min(candidates, key=lambda c: c[:3])[3] if candidates else None


def add_clusters(document: dict) -> dict:
    """Put ``clusters`` into a results document (before its results) and each failure's cluster number
    into its result (``cluster``); return the document."""
    results = document.pop("results", None) or []
    clusters, membership = cluster_failures(results)
    # new records, not the inputs' own: a merge's inputs keep their numbering, which means nothing here
    document["clusters"] = clusters
    document["results"] = [
        {**{k: v for k, v in record.items() if k != "cluster"}, **({"cluster": membership[record["id"]]} if record["id"] in membership else {})}
        for record in results
    ]
    return document


def document_clusters(document: dict) -> list[dict]:
    """The document's clusters, computed from its results where it has none (a document of an older suite)."""
    if isinstance(document.get("clusters"), list):
        return document["clusters"]
    return cluster_failures(document.get("results") or [])[0]


def cluster_of(document: dict) -> dict[str, dict]:
    """The cluster of each failing case, by case id."""
    clusters = document_clusters(document)
    by_number = {cluster["id"]: cluster for cluster in clusters}
    membership = {r["id"]: r.get("cluster") for r in document.get("results") or [] if r.get("cluster") in by_number}
    if not membership and clusters:  # the document's results carry no numbers: compute them
        membership = cluster_failures(document.get("results") or [])[1]
    return {case_id: by_number[number] for case_id, number in membership.items() if number in by_number}
