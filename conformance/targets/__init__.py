"""Targets: the implementations the suite judges. See ``base`` for the contract."""

from .base import KERNEL_OPS, WRAPPER_OPS, Target, TargetError, TargetUnavailable
from .registry import ENTRY_POINT_GROUP, known_targets, list_targets, load, resolve

__all__ = [
    "ENTRY_POINT_GROUP",
    "KERNEL_OPS",
    "WRAPPER_OPS",
    "Target",
    "TargetError",
    "TargetUnavailable",
    "known_targets",
    "list_targets",
    "load",
    "resolve",
]
