"""Every op the suite judges, as data (``OpSpec``), by name; the one registry the rest derives from.

The op lists a target is measured against (``ops_at(Level.KERNEL)``…), the ``reference`` target's
ops and ``describe`` all read ``OP_SPECS`` when asked, so adding an op is one spec (with its
reference function) passed to :func:`register`.
"""

from __future__ import annotations

from .kernel import KERNEL_OP_SPECS
from .level import LEVEL_ORDER, Level
from .moe import MOE_OP_SPECS
from .spec import KNOBS, OpCall, OpSpec
from .wrapper import WRAPPER_OP_SPECS, case_mapping

OP_SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (*KERNEL_OP_SPECS, *WRAPPER_OP_SPECS, *MOE_OP_SPECS)}
OP_NAMES = tuple(OP_SPECS)  # the built-in ops, in the design's order


def register(spec: OpSpec) -> OpSpec:
    """Add an op (a test's, or a new one while it is being written); its name must be new."""
    if spec.name in OP_SPECS:
        raise ValueError(f"op {spec.name!r} is already registered")
    OP_SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove an op added by :func:`register` (the built-in ones stay)."""
    if name in OP_NAMES:
        raise ValueError(f"op {name!r} is built in")
    OP_SPECS.pop(name, None)


def ops_at(level: Level) -> tuple[str, ...]:
    """The names of the registered ops of one level, in registration order."""
    return tuple(name for name, spec in OP_SPECS.items() if spec.level == level)


__all__ = [
    "KNOBS", "LEVEL_ORDER", "OP_NAMES", "OP_SPECS", "Level", "OpCall", "OpSpec", "case_mapping", "ops_at", "register", "unregister",
]  # fmt: skip
