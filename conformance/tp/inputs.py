"""Inputs are read-only on every rank too: a watch around the target's wrapper methods.

An op case checks that the call left every tensor but its output with the values it had
(``conformance.referee.modified_inputs``; a zero whose sign flipped or a NaN with another payload is
recorded, not failed: ``conformance.verdict.bit_differences``). A tensor-parallel rank calls the
wrapper several times on tensors the composition shares between calls (the activations, LoRA-A, the
gathered shrink buffer that ``add_expand`` reads), so a write into one of them corrupts a later call
or another rank's result, or passes unseen where the composition happens not to read it again. :class:`ReadOnlyInputs`
copies every tensor argument but the output (the first) before each call of a watched method and
compares after it by value; what changed is named by method and argument and reported with the rank's
answer, and so are the arguments that kept their values with other bits (``bit_level``).
"""

from __future__ import annotations

import inspect

import torch

from conformance.verdict.bit_differences import BitDifferences
from conformance.verdict.metrics import ValueComparison, compare_values

from .composition import WATCHED_WRAPPER_METHODS


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _compared(now: torch.Tensor, then: torch.Tensor) -> ValueComparison | None:
    """``now`` against ``then`` by value; None for another shape or dtype (a change of its own)."""
    return compare_values(now, then) if now.shape == then.shape and now.dtype == then.dtype else None


class ReadOnlyInputs:
    """``wrapper`` with its ``add_shrink`` / ``add_expand`` / ``add_lora_linear`` (and the MoE ``add_lora_w13`` /
    ``add_lora_w2``) watched; every other attribute passes through."""

    def __init__(self, wrapper) -> None:
        self._wrapper = wrapper
        self.modified: list[str] = []  # "add_expand modified its input 'x'", in call order, each once
        self.bit_level: list[BitDifferences] = []  # arguments handed back with equal values and other bits, each once

    def __getattr__(self, name: str):
        method = getattr(self._wrapper, name)
        if name not in WATCHED_WRAPPER_METHODS:
            return method
        names = list(inspect.signature(method).parameters)

        def watched(*args, **kwargs):
            inputs = [(names[i] if i < len(names) else f"argument {i}", value) for i, value in enumerate(args) if i > 0]
            inputs += list(kwargs.items())
            before = [(argument, [t.clone() for t in _tensors(value)], _tensors(value)) for argument, value in inputs]
            result = method(*args, **kwargs)
            for argument, copies, tensors in before:
                comparisons = [_compared(now, then) for now, then in zip(tensors, copies)]
                if any(comparison is None or comparison.changed.any() for comparison in comparisons):
                    text = f"{name} modified its input {argument!r}"
                    if text not in self.modified:
                        self.modified.append(text)
                    continue
                for comparison in comparisons:
                    entry = BitDifferences.of(comparison, f"{name}: {argument}", "input")
                    if entry is not None and entry not in self.bit_level:
                        self.bit_level.append(entry)
            return result

        return watched
