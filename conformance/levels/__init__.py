"""The levels of the contract, each a kind of one case (``conformance.levels.base.CaseKind``).

``KINDS`` is every level the session runs and the plugin makes tests of, in the order their cases are
listed: op cases (kernels and wrapper methods), tensor-parallel layer cases, end-to-end model cases.
Adding a level is one module here plus its cases, and one entry in ``KINDS``.
"""

from __future__ import annotations

from typing import Any

from .base import CaseKind
from .layer import LAYER
from .model import MODEL
from .op import OP

KINDS: tuple[CaseKind, ...] = (OP, MODEL, LAYER)


def kind_of(case: Any, kinds: tuple[CaseKind, ...] = KINDS) -> CaseKind:
    """The kind that owns ``case``; ``TypeError`` for a case no level owns."""
    for kind in kinds:
        if kind.owns(case):
            return kind
    raise TypeError(f"no level owns a case of type {type(case).__name__} (levels: {', '.join(k.name for k in kinds)})")


__all__ = ["KINDS", "LAYER", "MODEL", "OP", "CaseKind", "kind_of"]
