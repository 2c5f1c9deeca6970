"""The golden reference: every Punica LoRA op in plain PyTorch, written to be read.

One op per ``op_*.py`` module, spec first; the module docstring is the op's definition. Tensors are
computed in float64 when given float64 (the oracle) and in any other dtype on request (the
low-precision baseline: float32 accumulation, rounding where vLLM's kernels round). Rows are grouped
by adapter; no weight is gathered per token. This package imports nothing else of the suite.
"""

from ._grouping import NO_ADAPTER, rows_per_adapter
from ._stacks import weight_stack
from .kernel_meta import LoRAKernelMeta
from .mapping import LoRAMapping, SegmentMetadata
from .op_bgmv_expand import bgmv_expand
from .op_bgmv_expand_slice import bgmv_expand_slice
from .op_bgmv_shrink import bgmv_shrink
from .op_fused_moe_lora import fused_moe_lora
from .op_fused_moe_lora_fp8 import fused_moe_lora_fp8
from .op_lora_expand import lora_expand
from .op_lora_expand_fp8 import lora_expand_fp8
from .op_lora_shrink import lora_shrink
from .op_lora_shrink_fp8 import lora_shrink_fp8
from .op_moe_lora_align_block_size import alignment_problems, moe_lora_align_block_size
from .op_sgmv_expand import sgmv_expand
from .op_sgmv_expand_slice import sgmv_expand_slice
from .op_sgmv_shrink import sgmv_shrink
from .punica_wrapper import PunicaWrapperReference, aligned_buffers, aligned_sizes

__all__ = [
    "NO_ADAPTER",
    "LoRAKernelMeta",
    "LoRAMapping",
    "PunicaWrapperReference",
    "aligned_buffers",
    "aligned_sizes",
    "alignment_problems",
    "SegmentMetadata",
    "bgmv_expand",
    "bgmv_expand_slice",
    "bgmv_shrink",
    "fused_moe_lora",
    "fused_moe_lora_fp8",
    "lora_expand",
    "lora_expand_fp8",
    "lora_shrink",
    "lora_shrink_fp8",
    "moe_lora_align_block_size",
    "rows_per_adapter",
    "sgmv_expand",
    "sgmv_expand_slice",
    "sgmv_shrink",
    "weight_stack",
]
