"""``vllm-hpu``: the installed vllm-gaudi plugin's ``PunicaWrapperHPU`` on Intel Gaudi.

vllm-gaudi (github.com/vllm-project/vllm-gaudi, not on PyPI) runs LoRA with
``vllm_gaudi.lora.punica_wrapper.punica_hpu.PunicaWrapperHPU``, which ignores vLLM's index tensors
for the matmuls and reads a process-global mask, ``vllm_gaudi.extension.ops.LoraMask``, that the
model runner sets per step: ``[T, L·R]`` in the LoRA dtype, 1 in the row's slot block
(``create_lora_mask``), and a separate one with one row per sampled row before the logits
(docs/gaudi-lora.md §2, §3). This target is a ``VllmPunicaWrapperTarget`` (construction, metadata and
forwarding by argument name, so older plugins' positional ``lora_bias_stacked`` needs nothing) that
stands in for the runner: before every call it builds that mask from the suite's mapping and sets it
(:meth:`VllmHpuTarget.call_wrapper`), then calls the plugin's method unchanged. Older stacks (the
in-tree ``vllm.lora.punica_wrapper.punica_hpu`` with ``vllm_hpu_extension.ops.LoraMask``) are tried too.

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
from typing import Any, ClassVar

import torch

from ..base import TargetUnavailable
from ..vllm_wrapper import VllmPunicaWrapperTarget
from .buckets import BucketPolicy
from .device import BRIDGE, BRIDGE_DESCRIPTION, HpuDeviceLayer, load_runtime, requested_mode
from .rows import PaddedRows
from .stacks import as_3d

TARGET = "vllm-hpu"
PLUGIN = "vllm_gaudi"
PLUGIN_DESCRIPTION = "vllm_gaudi (vLLM's Gaudi plugin, not on PyPI: install it from github.com/vllm-project/vllm-gaudi)"
# The LoraMask the runner sets before each method: built over which rows (the tokens, or the sampled rows
# before the logits), from which stack (its first slice where it is a tuple), whose dim holds the rank.
MASKS = {
    "add_shrink": ("token_slots", "lora_a_stacked", 1),
    "add_expand": ("token_slots", "lora_b_stacked", 2),
    "add_lora_embedding": ("token_slots", "lora_b_stacked", 2),
    "add_lora_linear": ("token_slots", "lora_a_stacked", 1),
    "add_lora_logits": ("sampled_slots", "lora_a_stacked", 1),
}
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


class VllmHpuTarget(VllmPunicaWrapperTarget):
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
    mask_holder: ClassVar[Any] = None

    @classmethod
    def check_available(cls) -> None:
        reason = _missing_reason()
        if reason:
            raise TargetUnavailable(reason)
        load_runtime(requested_mode(), cls.name)  # configures and loads the bridge before the plugin imports it
        cls.wrapper_class = _import_first(WRAPPER_MODULES, "PunicaWrapperHPU")
        cls.mask_holder = _import_first(MASK_MODULES, "LoraMask")
        super().check_available()

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("hpu")

    def __init__(self) -> None:
        super().__init__()
        self.layer = HpuDeviceLayer(load_runtime(requested_mode(), self.name), requested_mode())

    def unsupported_reason(self, case) -> str | None:
        # after the op and the dtype, before the wrapper's own signature: the runner refuses bias altogether
        if case.bias and case.op in self.implemented_ops() and case.torch_dtype in self.dtypes:
            return "vllm-gaudi has no LoRA bias (its HPU model runner asserts not lora_config.bias_enabled)"
        return super().unsupported_reason(case)

    def synchronize(self) -> None:
        self.layer.synchronize()

    # -- the runner's part: the masks ---------------------------------------------------------------

    def _set_mask(self, slots: tuple[int, ...], stack: torch.Tensor, rank_dim: int) -> None:
        """Set the plugin's global LoraMask as its runner would: ``[rows, L·R]`` in the LoRA dtype."""
        weights = as_3d(stack)
        rows = PaddedRows.from_slots(torch.tensor(slots, dtype=torch.int32), BucketPolicy.none(), self.device)
        mask = rows.mask(weights.size(0), weights.size(rank_dim)).to(weights.dtype)
        setter = getattr(self.mask_holder, "setLoraMask", None) or self.mask_holder.set_lora_mask
        setter(mask)

    def call_wrapper(self, method: str, arguments: dict[str, Any], lora_bias_stacked=None, extra=None) -> None:
        """The plugin's method as its runner calls it: the LoraMask of this method's rows set first."""
        if method in MASKS:
            rows, stack_name, rank_dim = MASKS[method]
            stack = arguments[stack_name]
            self._set_mask(getattr(self.mapping, rows), stack[0] if isinstance(stack, tuple | list) else stack, rank_dim)
        super().call_wrapper(method, arguments, lora_bias_stacked, extra)
        self.layer.after_op()
