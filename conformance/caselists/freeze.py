"""Freezing a profile's drawing into a case list, and recomputing a listed case's digests.

:func:`freeze` is the maintainer's half (``python -m conformance.caselists write``): the profile's cases of
every built-in level, drawn as a run draws them, each with the digest of its inputs. :func:`rejudge_entry`
is the reviewer's: from a listed case alone, the digest of its inputs and the fingerprint of its float64
oracle, computed again in the reviewer's process (``lora-conformance verify --rejudge``).
"""

from __future__ import annotations

import json
import platform

import torch

import conformance
from conformance.digest import oracle_fingerprint, tensors_digest
from conformance.generator.cache import hypothesis_version
from conformance.levels import BUILT_IN_KINDS, CaseKind
from conformance.ops import OP_SPECS
from conformance.referee import Oracle
from conformance.runner import make_values

from .caselist import CaselistEntry, CaselistError


def freeze(profile: str, seed: int = 0, kinds: tuple[CaseKind, ...] = BUILT_IN_KINDS) -> tuple[dict, list[CaselistEntry]]:
    """The header fields (without count and digest) and the entries of ``profile``'s cases at ``seed``.

    Every case must read back from its JSON as the same case (a field its JSON loses would make the
    list run another case than the one drawn): checked here, for every case."""
    entries = []
    for kind in kinds:
        for case_id, case in kind.cases(profile, seed):
            data = json.loads(json.dumps(case.to_json()))  # as the list stores it: tuples become lists
            if kind.case_from_json(data) != case:
                raise CaselistError(f"the {kind.name} case {case_id} does not read back from its JSON as the same case: "
                                    "its to_json/from_json lose a field; fix them before freezing a list")
            entries.append(CaselistEntry(case_id, kind.name, data, kind.inputs_digest(case)))
    header = {
        "suite_version": conformance.__version__, "profile": profile, "seed": seed,
        "generated_with": {"hypothesis": hypothesis_version(), "torch": torch.__version__, "python": platform.python_version()},
    }
    return header, entries


def rejudge_entry(entry: CaselistEntry, kinds: tuple[CaseKind, ...] = BUILT_IN_KINDS) -> dict:
    """``{"inputs_digest", "oracle_fingerprint"}`` of a listed case, computed here from its JSON alone.

    The fingerprint is the op level's float64 oracle (``conformance.referee.Oracle``); None for an op judged by
    its invariants and for the other levels, whose results record none."""
    kind = _kind(entry.level, kinds)
    case = kind.case_from_json(entry.case_json)
    if kind.name != "op":
        return {"inputs_digest": kind.inputs_digest(case), "oracle_fingerprint": None}
    values = make_values(case)
    spec = OP_SPECS[case.op]
    fingerprint = oracle_fingerprint(Oracle.of(spec, case, values).output) if spec.check is None else None
    return {"inputs_digest": tensors_digest(values), "oracle_fingerprint": fingerprint}


def _kind(level: str, kinds: tuple[CaseKind, ...]) -> CaseKind:
    for kind in kinds:
        if kind.name == level:
            return kind
    raise CaselistError(f"the list names the level {level!r}, which this suite does not have (levels: {', '.join(k.name for k in kinds)})")
