"""What the vLLM-backed targets share: finding vLLM, and speaking its mapping and wrapper API.

vLLM's wrappers take adapter *ids* (0 = none) and a slot table ``lora_index_to_id``; the suite speaks
slots. Slot ``l`` is given id ``l + 1``, so ``lora_index_to_id = [1, 2, …, L]`` and −1 ↔ id 0.
The wrapper API moved between vLLM releases (LoRA bias came and went); calls are adapted to the
installed signatures, and what the installed vLLM cannot express is reported not supported.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from conformance.reference import LoRAMapping

from .base import TargetUnavailable


def import_vllm_module(name: str, target: str) -> Any:
    """Import a vLLM module or raise :class:`TargetUnavailable` naming the package to install."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise TargetUnavailable(
            f"target {target!r} needs vLLM ({name} failed to import: {exc}); "
            "install it, e.g. pip install -c constraints/cpu.txt 'lora-conformance[vllm]'"
        ) from exc


def vllm_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except Exception:  # noqa: BLE001 - only for messages
        return "unknown"


def vllm_lora_mapping(mapping: LoRAMapping):
    """vLLM's ``LoRAMapping`` (ids, not slots) for the suite's slot mapping."""
    layers = import_vllm_module("vllm.lora.layers", "vllm")
    return layers.LoRAMapping(
        index_mapping=tuple(slot + 1 for slot in mapping.token_slots),
        prompt_mapping=tuple(slot + 1 for slot in mapping.sampled_slots),
        is_prefill=mapping.is_prefill,
    )


def lora_index_to_id(num_slots: int) -> list[int | None]:
    return list(range(1, num_slots + 1))


def needs_lora_bias(case) -> bool:
    """The case passes ``lora_bias_stacked``. A full-linear head's bias is an argument of its own
    (``apply_lora_full_linear``'s ``bias_stacked``, always there), not LoRA bias."""
    return case.bias and case.op != "apply_lora_full_linear"


def accepts_keyword(function, name: str) -> bool:
    return name in inspect.signature(function).parameters


class VllmWrapperMethods:
    """The five wrapper methods, forwarded to a vLLM ``PunicaWrapper`` held in ``self.wrapper``.

    LoRA bias is forwarded only where the installed vLLM accepts ``lora_bias_stacked``; elsewhere
    ``unsupported_reason`` declares bias cases not supported. ``apply_lora_full_linear`` (the
    classification heads, vLLM ≥ 0.32) is forwarded only where the installed wrapper class implements
    it; elsewhere the attribute is ``None``, so the op is not implemented rather than crashing.
    """

    wrapper: Any

    def supports_bias(self) -> bool:
        return accepts_keyword(self.wrapper_class.add_lora_linear, "lora_bias_stacked")

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        self.wrapper.add_shrink(y, x, lora_a_stacked, scale, **kwargs)

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, *, lora_bias_stacked=None, **kwargs):
        if lora_bias_stacked is not None:
            kwargs["lora_bias_stacked"] = lora_bias_stacked
        self.wrapper.add_expand(y, x, lora_b_stacked, output_slices, offset_start=offset_start, add_inputs=add_inputs, **kwargs)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, lora_bias_stacked=None, **kwargs):
        if lora_bias_stacked is not None:
            kwargs["lora_bias_stacked"] = lora_bias_stacked
        self.wrapper.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs)

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        self.wrapper.add_lora_embedding(y, x, lora_b_stacked, add_inputs=add_inputs, **kwargs)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        self.wrapper.add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)

    # Said when the installed wrapper lacks the method (the property below returns None then).
    FULL_LINEAR_MISSING = (
        "the installed vLLM's wrapper has no apply_lora_full_linear (the classification heads' full linear, added in vLLM 0.32)"
    )

    @property
    def apply_lora_full_linear(self):
        # A property, because whether the op exists depends on the installed vLLM, not on this class.
        method = getattr(getattr(self, "wrapper_class", None), "apply_lora_full_linear", None)
        if method is None or getattr(method, "__isabstractmethod__", False):
            return None
        return self._forward_full_linear

    def _forward_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        self.wrapper.apply_lora_full_linear(y, x, weight_stacked, bias_stacked, module_enabled)
