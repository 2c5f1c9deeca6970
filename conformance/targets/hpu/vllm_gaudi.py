"""``vllm-hpu``: the installed vllm-gaudi plugin's ``PunicaWrapperHPU`` on Intel Gaudi.

vllm-gaudi (github.com/vllm-project/vllm-gaudi, not on PyPI) runs LoRA with
``vllm_gaudi.lora.punica_wrapper.punica_hpu.PunicaWrapperHPU``, which ignores vLLM's index tensors
for the matmuls and reads a process-global mask, ``vllm_gaudi.extension.ops.LoraMask``, that the
model runner sets per step: ``[T, L·R]`` in the LoRA dtype, 1 in the row's slot block
(``create_lora_mask``), and a separate one with one row per sampled row before the logits
(docs/gaudi-lora.md §2, §3). This target stands in for the runner: before every call it builds
that mask from the suite's mapping and sets it, then calls the plugin's method unchanged. Older stacks
(the in-tree ``vllm.lora.punica_wrapper.punica_hpu`` with ``vllm_hpu_extension.ops.LoraMask``) are
tried too; the wrapper API variants (``lora_bias_stacked`` as a positional argument) are adapted.

What the plugin does not implement is reported, not hidden: LoRA bias is declared not supported (the
HPU runner asserts ``not bias_enabled``); ``add_shrink`` / ``add_expand`` raise ``NotImplementedError``
in plugin versions before vllm-gaudi#1403 (→ "not supported"); no kernel ops. Whatever else it gets
wrong (``add_inputs=False`` of the embedding, ``offset_start``, NaN leaks) shows as failures.

Nothing is imported at module import time; ``check_available`` loads the Habana runtime first (with
``device.load_runtime``'s environment), then the plugin, and says in one line what is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any, ClassVar

import torch

from conformance.reference import LoRAMapping

from .._vllm import lora_index_to_id, vllm_lora_mapping
from ..base import Target, TargetUnavailable
from ..classification_head import TokenHeadFromShrink
from .buckets import BucketPolicy
from .device import BRIDGE, BRIDGE_DESCRIPTION, HpuDeviceLayer, load_runtime, requested_mode
from .rows import PaddedRows
from .stacks import as_3d

TARGET = "vllm-hpu"
PLUGIN = "vllm_gaudi"
PLUGIN_DESCRIPTION = "vllm_gaudi (vLLM's Gaudi plugin, not on PyPI: install it from github.com/vllm-project/vllm-gaudi)"
WRAPPER_MODULES = ("vllm_gaudi.lora.punica_wrapper.punica_hpu", "vllm.lora.punica_wrapper.punica_hpu")
MASK_MODULES = ("vllm_gaudi.extension.ops", "vllm_hpu_extension.ops")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _missing_reason() -> str | None:
    """Both packages are needed; name every missing one (without importing anything)."""
    missing = [name for name in (BRIDGE, PLUGIN) if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    described = {BRIDGE: BRIDGE_DESCRIPTION, PLUGIN: PLUGIN_DESCRIPTION}
    which = "neither is installed" if len(missing) == 2 else f"{missing[0]} is not installed"
    return f"target {TARGET!r} needs {described[BRIDGE]} and {described[PLUGIN]}; {which}"


def _import_first(names: tuple[str, ...], attribute: str) -> Any:
    errors = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a broken install fails in many ways
            errors.append(f"{name}: {_one_line(exc)}")
            continue
        if hasattr(module, attribute):
            return getattr(module, attribute)
        errors.append(f"{name} has no {attribute}")
    raise TargetUnavailable(f"target {TARGET!r}: cannot find {attribute} in the installed vllm-gaudi ({'; '.join(errors)})")


class VllmHpuTarget(TokenHeadFromShrink, Target):
    name = TARGET
    description = "the installed vllm-gaudi plugin's PunicaWrapperHPU (global LoraMask) on Intel Gaudi"
    generation_engine = "vllm"  # end to end: the real engine, LLM(enable_lora=True)
    # vllm-gaudi (read at its August 2026 head) has no MoE LoRA: PunicaWrapperHPU defines none of vLLM's
    # fused-MoE methods and the plugin registers no MoE LoRA kernel.
    why_not_implemented = {
        op: f"vllm-gaudi has no MoE LoRA: PunicaWrapperHPU implements no {op} (nor add_lora_fused_moe), and the plugin ships no fused-MoE LoRA kernel"
        for op in ("add_lora_w13", "add_lora_w2", "fused_moe_lora", "fused_moe_lora_fp8", "moe_lora_align_block_size")
    } | {
        # vLLM 0.32's classification-head full linear (ClassificationHeadWithLoRA); vLLM's GPU/CPU/XPU wrappers have it
        "apply_lora_full_linear": "vllm-gaudi's PunicaWrapperHPU has no apply_lora_full_linear (vLLM's classification-head full linear)",
    } | {
        # the plugin's wrapper computes through the global LoraMask in its own methods; it exposes no kernel op
        op: f"vllm-gaudi exposes no {op} kernel: PunicaWrapperHPU computes LoRA inside its wrapper methods (the `hpu` target judges the suite's Gaudi kernels)"
        for op in (
            "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice",
            "lora_shrink", "lora_expand", "lora_shrink_fp8", "lora_expand_fp8",
        )
    }
    wrapper_class: ClassVar[type | None] = None
    mask_holder: ClassVar[Any] = None

    @classmethod
    def check_available(cls) -> None:
        reason = _missing_reason()
        if reason:
            raise TargetUnavailable(reason)
        load_runtime(requested_mode(), cls.name)  # configures and loads the bridge before the plugin imports it
        cls.wrapper_class = _import_first(WRAPPER_MODULES, "PunicaWrapperHPU")
        cls.mask_holder = _import_first(MASK_MODULES, "LoraMask")

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("hpu")

    def __init__(self) -> None:
        super().__init__()
        self.layer = HpuDeviceLayer(load_runtime(requested_mode(), self.name), requested_mode())
        self.wrapper = None
        self.mapping: LoRAMapping | None = None

    def unsupported_reason(self, case) -> str | None:
        if (reason := super().unsupported_reason(case)) is not None:  # the base's reasons first
            return reason
        if case.bias:
            return "vllm-gaudi has no LoRA bias (its HPU model runner asserts not lora_config.bias_enabled)"
        return None

    def synchronize(self) -> None:
        self.layer.synchronize()

    # -- the runner's part: mapping and masks -------------------------------------------------

    def update_metadata(self, mapping: LoRAMapping) -> None:
        self.mapping = mapping
        tokens = max(len(mapping.token_slots), len(mapping.sampled_slots), 1)
        self.wrapper = self.wrapper_class(tokens, max(len(mapping.seq_lens), 1), self.device)
        arguments = dict(vocab_size=1)
        if "extra_vocab_size" in inspect.signature(self.wrapper.update_metadata).parameters:
            arguments["extra_vocab_size"] = 0
        # vLLM's model manager passes lora_slots + 1 as max_loras.
        self.wrapper.update_metadata(
            vllm_lora_mapping(mapping), lora_index_to_id(mapping.num_slots), mapping.num_slots + 1, **arguments
        )

    def _set_mask(self, slots: tuple[int, ...], stack: torch.Tensor, rank_dim: int) -> None:
        """Set the plugin's global LoraMask as its runner would: ``[rows, L·R]`` in the LoRA dtype."""
        weights = as_3d(stack)
        rows = PaddedRows.from_slots(torch.tensor(slots, dtype=torch.int32), BucketPolicy.none(), self.device)
        mask = rows.mask(weights.size(0), weights.size(rank_dim)).to(weights.dtype)
        setter = getattr(self.mask_holder, "setLoraMask", None) or self.mask_holder.set_lora_mask
        setter(mask)

    def _call(self, method: str, *args, **kwargs) -> None:
        getattr(self.wrapper, method)(*args, **kwargs)
        self.layer.after_op()

    def _takes_bias(self, method: str) -> bool:
        return "lora_bias_stacked" in inspect.signature(getattr(self.wrapper, method)).parameters

    # -- the wrapper methods ------------------------------------------------------------------

    def token_lora_slots(self) -> torch.Tensor:
        return self.wrapper.token_lora_indices  # what vLLM's token head reads

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        self._set_mask(self.mapping.token_slots, lora_a_stacked[0], 1)
        self._call("add_shrink", y, x, lora_a_stacked, scale, **kwargs)

    def add_expand(
        self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, *, lora_bias_stacked=None, **kwargs
    ):
        self._set_mask(self.mapping.token_slots, lora_b_stacked[0], 2)
        if self._takes_bias("add_expand"):  # older plugin: lora_bias_stacked positional before output_slices
            self._call("add_expand", y, x, lora_b_stacked, lora_bias_stacked, output_slices, offset_start, add_inputs, **kwargs)
        else:
            self._call("add_expand", y, x, lora_b_stacked, output_slices, offset_start, add_inputs, **kwargs)

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        self._set_mask(self.mapping.token_slots, lora_b_stacked, 2)
        self._call("add_lora_embedding", y, x, lora_b_stacked, add_inputs, **kwargs)

    def add_lora_linear(
        self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, lora_bias_stacked=None, **kwargs
    ):
        self._set_mask(self.mapping.token_slots, lora_a_stacked[0], 1)
        stacks = (lora_a_stacked, lora_b_stacked)
        if self._takes_bias("add_lora_linear"):  # older plugin: lora_bias_stacked positional before scale
            self._call("add_lora_linear", y, x, *stacks, lora_bias_stacked, scale, output_slices, buffer=buffer, **kwargs)
        else:
            self._call("add_lora_linear", y, x, *stacks, scale, output_slices, buffer=buffer, **kwargs)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        self._set_mask(self.mapping.sampled_slots, lora_a_stacked, 1)
        self._call("add_lora_logits", y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)
