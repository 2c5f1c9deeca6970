"""A bundle's records against the frozen case list it names (``conformance.caselists``).

The list is the population the verdict speaks for: every case of it has exactly one record, none is
extra or duplicated, and each record holds the list's case (its JSON, field for field) judged on the
list's inputs (the digest of the input values the run drew, ``inputs_digest``). A case the target did
not run (not supported) drew no inputs and may record none. The list itself must be one this suite
release ships, by name and digest: a bundle of another list, an edited one or one of another release
says nothing about this release's list.
"""

from __future__ import annotations

from collections import Counter

from conformance.verdict import Outcome

SHOWN = 8  # ids named in one message; the count says how many more


def listed_ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:SHOWN])
    return shown + (f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else "")


def released_list(claimed: dict, released: dict, load) -> tuple[object | None, str | None]:
    """The released list a bundle's ``caselist`` entry ({"name", "digest"}) names, or why it is none.

    ``released``: name → path of the lists this release ships; ``load``: ``load_caselist``."""
    name, digest = claimed.get("name"), claimed.get("digest")
    if name not in released:
        shipped = ", ".join(sorted(released)) or "none"
        return None, (f"it names case list {name!r}, which this suite release does not ship (it ships: {shipped}): "
                      "a verdict over another list is no verdict over a released one; run a released list (certify --caselist NAME)")
    try:
        caselist = load(released[name])
    except ValueError as exc:  # CaselistError: the release's own file, damaged in this installation
        return None, f"this installation's list {name!r} cannot be read ({exc}); reinstall the suite release"
    if digest != caselist.digest:
        return None, (f"it names case list {name!r} with digest {digest}, but this release's {name!r} has digest {caselist.digest}: "
                      "the cases were edited, or come from another release; run the released list with this release")
    return caselist, None


def population_problems(records: list[dict], caselist) -> list[str]:
    """Missing, extra and duplicated records against ``caselist``'s entries."""
    counts = Counter(record.get("id") for record in records)
    expected = [entry.case_id for entry in caselist.entries]
    problems = []
    missing = [case_id for case_id in expected if case_id not in counts]
    if missing:
        problems.append(f"{len(missing)} case(s) of list {caselist.name!r} have no result: {listed_ids(missing)}")
    listed = set(expected)
    extra = sorted(str(case_id) for case_id in counts if case_id not in listed)
    if extra:
        problems.append(f"{len(extra)} result(s) are of no case of list {caselist.name!r}: {listed_ids(extra)}")
    duplicated = sorted(str(case_id) for case_id, count in counts.items() if count > 1)
    if duplicated:
        problems.append(f"{len(duplicated)} case(s) have more than one result: {listed_ids(duplicated)}")
    return problems


def record_problems(record: dict, entry) -> list[str]:
    """Where one record does not hold its list entry's case and inputs."""
    problems = []
    case = record.get("case")
    if case != entry.case_json:
        if not isinstance(case, dict):
            problems.append("records no case object")
        else:
            field = next(name for name in [*entry.case_json, *case] if case.get(name, _ABSENT) != entry.case_json.get(name, _ABSENT))
            problems.append(f"its case has {field!r} = {case.get(field, 'nothing')!r}, but the list's case has "
                            f"{entry.case_json.get(field, 'nothing')!r}: another case under this id")
    digest = record.get("inputs_digest")
    if digest != entry.inputs_digest and not (digest is None and record.get("outcome") == Outcome.NOT_SUPPORTED.value):
        problems.append(f"it was judged on inputs {digest}, but the list's inputs for it are {entry.inputs_digest}: "
                        "its outcome is not of this case's inputs")
    return problems


_ABSENT = object()
