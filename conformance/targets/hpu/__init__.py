"""This project's HPU (Intel Gaudi) multi-LoRA implementation, and the targets that judge it.

Gaudi runs LoRA as dense, mask-based BGMV: every adapter's product at once, the row's own adapter
kept by a mask, all shapes static so one compiled graph per bucket serves every adapter mix
(docs/gaudi-lora.md). This package implements that, runnable on Gaudi and on the CPU, with the
deliberate differences documented in ``mask_math`` (``where`` instead of multiplying by the mask;
vLLM's rounding points) and the mask passed explicitly instead of through a global. See docs/hpu.md.

One idea per module:

* ``stacks``       weight-stack layouts, the flattened forms, and their cache (identity + version);
* ``buckets``      row counts padded up to static bucket sizes;
* ``rows``         the row state of a call: padded slot vector, masks built from it on the device;
* ``mask_math``    the mask-based math (two dense GEMMs, ``torch.where``);
* ``gather_math``  the earlier gather-based math (per-row ``index_select``), for comparison;
* ``grouped_moe``  MoE LoRA grouped by (slot, expert) into static blocks: one weight gather per block, ``bmm``;
* ``moe_align``    the (slot, expert) block alignment of the MoE pairs;
* ``writeback``    how results land in the output (vLLM's rounding, untouched rows bit-identical);
* ``engine``       one shrink / expand / fused step into caller tensors (padding, cache, device hooks);
* ``wrapper``      vLLM's PunicaWrapper methods;  ``kernels``  vLLM's kernel ops;
* ``fp8``          the fp8 kernel ops' dequantization and math (CPU, Gaudi 2's byte table, Gaudi 3's fp8 GEMM);
* ``device``       CPU no-ops or the Habana runtime (lazy import, mode, mark_step, HPU graphs);
* ``targets``      ``hpu``, ``hpu-gather``, ``hpu-emulated``, ``hpu-emulated-gather``;
* ``vllm_wrapper`` the implementation as a subclass of vLLM's ``PunicaWrapperBase``;
* ``vllm_gaudi``   ``vllm-hpu``: the installed vllm-gaudi plugin's ``PunicaWrapperHPU``.

Importing this package imports neither ``habana_frameworks`` nor vLLM.
"""

from .buckets import BucketPolicy
from .engine import LoRAEngine
from .targets import HpuEmulatedGatherTarget, HpuEmulatedTarget, HpuGatherTarget, HpuTarget
from .wrapper import HpuPunicaWrapper

__all__ = [
    "BucketPolicy",
    "HpuEmulatedGatherTarget",
    "HpuEmulatedTarget",
    "HpuGatherTarget",
    "HpuPunicaWrapper",
    "HpuTarget",
    "LoRAEngine",
]
