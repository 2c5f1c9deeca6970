"""The levels of the contract, each a kind of one case (``conformance.levels.base.CaseKind``).

``KINDS`` is every level the session runs and the plugin makes tests of, in the order their cases are
listed: op cases (kernels and wrapper methods), end-to-end model cases, tensor-parallel layer cases, serving
cases (one target instance step after step), then
the levels installed packages declare. A third party's level is a package with an entry point in the
group ``lora_conformance.levels`` naming its ``CaseKind`` instance (``examples/custom_level``): the
session lists, runs, journals, reports and gates its cases as it does the built-in ones.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from .base import BREAKDOWNS, CaseKind, breakdown_message
from .context import LevelContext
from .layer import LAYER
from .model import MODEL
from .op import OP
from .serving import SERVING

LEVELS_GROUP = "lora_conformance.levels"
BUILT_IN_KINDS: tuple[CaseKind, ...] = (OP, MODEL, LAYER, SERVING)


class LevelError(RuntimeError):
    """An installed package declares a level the suite cannot use."""


def installed_kinds(built_in: tuple[CaseKind, ...] = BUILT_IN_KINDS) -> tuple[CaseKind, ...]:
    """The levels installed packages declare (entry points of ``LEVELS_GROUP``), by entry point name.

    A level that does not load, is no ``CaseKind`` or reuses a level's name stops the suite with the
    entry point named: a level silently left out would pass a run that never judged its cases."""
    kinds: list[CaseKind] = []
    names = {kind.name for kind in built_in}
    for point in sorted(entry_points(group=LEVELS_GROUP), key=lambda p: p.name):
        where = f"the level {point.name!r} ({point.value}, entry point group {LEVELS_GROUP!r} of {point.dist.name if point.dist else 'a package'})"
        try:
            kind = point.load()
        except Exception as exc:
            raise LevelError(f"{where} does not import: {type(exc).__name__}: {exc}; fix or uninstall that package") from exc
        if not isinstance(kind, CaseKind):
            raise LevelError(f"{where} is a {type(kind).__name__}, not a conformance.levels.CaseKind instance; point it at one")
        if not kind.name or kind.name in names:
            raise LevelError(f"{where} is named {kind.name!r}, which {'is empty' if not kind.name else 'another level has'}; give it a name of its own")
        names.add(kind.name)
        kinds.append(kind)
    return tuple(kinds)


KINDS: tuple[CaseKind, ...] = BUILT_IN_KINDS + installed_kinds()


def kind_of(case: Any, kinds: tuple[CaseKind, ...] = KINDS) -> CaseKind:
    """The kind that owns ``case``; ``TypeError`` for a case no level owns."""
    for kind in kinds:
        if kind.owns(case):
            return kind
    raise TypeError(f"no level owns a case of type {type(case).__name__} (levels: {', '.join(k.name for k in kinds)})")


__all__ = ["BREAKDOWNS", "BUILT_IN_KINDS", "KINDS", "LAYER", "LEVELS_GROUP", "MODEL", "OP", "SERVING", "CaseKind", "LevelContext",
           "LevelError", "breakdown_message", "installed_kinds", "kind_of"]
