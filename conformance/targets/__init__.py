"""Targets: the implementations the suite judges. See ``base`` for the contract."""

from .base import KERNEL_OPS, WRAPPER_OPS, Target, TargetError, TargetUnavailable
from .registry import ENTRY_POINT_GROUP, known_targets, list_targets, load, resolve

__all__ = [
    "ENTRY_POINT_GROUP",
    "FunctionalKernelTarget",
    "KERNEL_OPS",
    "WRAPPER_OPS",
    "Target",
    "TargetError",
    "TargetUnavailable",
    "VllmPunicaWrapperTarget",
    "known_targets",
    "list_targets",
    "load",
    "resolve",
]


def __getattr__(name: str):
    # Exported lazily: it builds on KernelTarget, and the referee's process imports this package but must not
    # load target code (docs/architecture.md, "Who may import whom").
    if name == "FunctionalKernelTarget":
        from .functional import FunctionalKernelTarget

        return FunctionalKernelTarget
    if name == "VllmPunicaWrapperTarget":
        from .vllm_wrapper import VllmPunicaWrapperTarget

        return VllmPunicaWrapperTarget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
