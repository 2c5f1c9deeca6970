"""Inputs are read-only on every rank too: a watch around the target's wrapper methods.

An op case checks that the call left every tensor but its output bit for bit as it was
(``conformance.runner.modified_inputs``). A tensor-parallel rank calls the wrapper several times on
tensors the composition shares between calls (the activations, LoRA-A, the gathered shrink buffer
that ``add_expand`` reads), so a write into one of them corrupts a later call or another rank's
result, or passes unseen where the composition happens not to read it again. :class:`ReadOnlyInputs`
copies every tensor argument but the output (the first) before each call of a watched method and
compares after it; what changed is named by method and argument and reported with the rank's answer.
"""

from __future__ import annotations

import inspect

import torch

from conformance.verdict.metrics import bitwise_differences

from .composition import WATCHED_WRAPPER_METHODS


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _changed(now: torch.Tensor, then: torch.Tensor) -> bool:
    return now.shape != then.shape or now.dtype != then.dtype or bool(bitwise_differences(now, then).any())


class ReadOnlyInputs:
    """``wrapper`` with its ``add_shrink`` / ``add_expand`` / ``add_lora_linear`` (and the MoE ``add_lora_w13`` /
    ``add_lora_w2``) watched; every other attribute passes through."""

    def __init__(self, wrapper) -> None:
        self._wrapper = wrapper
        self.modified: list[str] = []  # "add_expand modified its input 'x'", in call order, each once

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
                if any(_changed(now, then) for now, then in zip(tensors, copies)):
                    text = f"{name} modified its input {argument!r}"
                    if text not in self.modified:
                        self.modified.append(text)
            return result

        return watched
