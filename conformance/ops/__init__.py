"""Every op the suite judges, as data (``OpSpec``), by name; the one registry the rest derives from.

The op lists a target is measured against (``ops_at(Level.KERNEL)``…), the ``reference`` target's
ops, ``describe``, ``KernelTarget``'s compositions and the op tables of the docs
(``conformance.ops.tables``) all read ``OP_SPECS`` when asked, so adding an op is one spec (with its
reference function) passed to :func:`register`.
"""

from __future__ import annotations

from conformance.cases.knobs import KNOBS

from .kernel import KERNEL_OP_SPECS
from .layers import LAYER_OP_SPECS
from .level import LEVEL_ORDER, Level
from .moe import MOE_OP_SPECS
from .spec import COMPOSITIONS, OUTPUT_KINDS, OpCall, OpSpec
from .wrapper import WRAPPER_OP_SPECS, case_mapping


def _check_parts(spec: OpSpec, registry: dict[str, OpSpec]) -> None:
    """The ops a wrapper op is composed of must be registered, kernel ops in a composition and wrapper ops
    in ``composed_of``; checked here rather than in the spec, which cannot see the registry."""

    def not_at(level: Level, names: tuple[str, ...]) -> list[str]:
        return [name for name in names if name not in registry or registry[name].level != level]

    for path, kernels in spec.compositions.items():
        if missing := not_at(Level.KERNEL, kernels):
            raise ValueError(f"op {spec.name}: its {path} composition calls {missing}, which are not registered kernel ops")
    if missing := not_at(Level.WRAPPER, spec.composed_of):
        raise ValueError(f"op {spec.name}: composed of {missing}, which are not registered wrapper ops")


OP_SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (*KERNEL_OP_SPECS, *WRAPPER_OP_SPECS, *MOE_OP_SPECS, *LAYER_OP_SPECS)}
OP_NAMES = tuple(OP_SPECS)  # the built-in ops, in the design's order
for _built_in in OP_SPECS.values():
    _check_parts(_built_in, OP_SPECS)
del _built_in


def register(spec: OpSpec) -> OpSpec:
    """Add an op (a test's, or a new one while it is being written); its name must be new."""
    if spec.name in OP_SPECS:
        raise ValueError(f"op {spec.name!r} is already registered")
    _check_parts(spec, OP_SPECS)
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
    "COMPOSITIONS", "KNOBS", "LEVEL_ORDER", "OP_NAMES", "OP_SPECS", "OUTPUT_KINDS", "Level", "OpCall", "OpSpec", "case_mapping",
    "ops_at", "register", "unregister",
]  # fmt: skip
