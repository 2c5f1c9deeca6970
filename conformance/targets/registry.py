"""Finding targets by name: the built-ins, vendors' entry points, and ``package.module:Class``.

A vendor package registers its target in its own ``pyproject.toml``::

    [project.entry-points."lora_conformance.targets"]
    mychip = "mychip_lora.conformance:MyChipTarget"

and ``pytest conformance --target=mychip`` finds it. A target requested by name that does not resolve
or cannot run here is an error naming the cause, never a skip.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points

from .base import Target, TargetError, TargetUnavailable

ENTRY_POINT_GROUP = "lora_conformance.targets"

BUILTIN_TARGETS: dict[str, str] = {
    "reference": "conformance.targets.reference:ReferenceTarget",
    "cpu": "conformance.targets.vllm_cpu:VllmCpuTarget",
    "cuda": "conformance.targets.vllm_cuda:VllmCudaTarget",
    "hpu": "conformance.targets.hpu.targets:HpuTarget",
    "hpu-gather": "conformance.targets.hpu.targets:HpuGatherTarget",
    "hpu-emulated": "conformance.targets.hpu.targets:HpuEmulatedTarget",
    "hpu-emulated-gather": "conformance.targets.hpu.targets:HpuEmulatedGatherTarget",
    "vllm-hpu": "conformance.targets.hpu.vllm_gaudi:VllmHpuTarget",
}


def known_targets() -> dict[str, str]:
    """Every registered name and the ``module:Class`` it points to (entry points may not shadow built-ins)."""
    known = dict(BUILTIN_TARGETS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        known.setdefault(ep.name, ep.value)
    return known


def resolve(name: str) -> type[Target]:
    """The target class for a registered name or a ``package.module:Class`` reference."""
    known = known_targets()
    reference = known.get(name, name if ":" in name else None)
    if reference is None:
        raise TargetError(f"unknown target {name!r}; known targets: {', '.join(sorted(known))} (or package.module:Class)")
    module_name, _, class_name = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"target {name!r}: cannot import module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Target)):
        raise TargetError(f"target {name!r}: {reference!r} is not a subclass of conformance.targets.Target")
    return cls


def load(name: str) -> Target:
    """An instance of the named target, or :class:`TargetError` / :class:`TargetUnavailable`."""
    return resolve(name)()


@dataclass(frozen=True)
class TargetStatus:
    name: str
    reference: str
    usable: bool
    reason: str


def list_targets() -> list[TargetStatus]:
    """Every known target with whether it can run here, and why not."""
    statuses = []
    for name, reference in sorted(known_targets().items()):
        try:
            resolve(name).check_available()
        except (TargetError, TargetUnavailable) as exc:
            statuses.append(TargetStatus(name, reference, False, str(exc)))
        else:
            statuses.append(TargetStatus(name, reference, True, "usable"))
    return statuses
