"""fp8 (e4m3) quantization as vLLM 0.32 applies it to an ``fp8`` MoE checkpoint served with LoRA.

Weights (the checkpoint, :func:`dequantize_experts` called by ``conformance.e2e.checkpoint``): each expert's
``w1``/``w3``/``w2`` is stored as ``float8_e4m3fn`` with a per-tensor ``weight_scale``. vLLM's
``Fp8MoEMethod.process_weights_after_loading`` (``vllm/model_executor/layers/quantization/fp8.py``) needs one
scale for the fused ``w13`` of an expert, so ``process_fp8_weight_tensor_strategy_moe``
(``…/quantization/utils/fp8_utils.py``) dequantizes ``w1`` and ``w3`` (``per_tensor_dequantize`` in
``…/utils/w8a8_utils.py``: the fp8 values as float16, times the scale) and quantizes both again with the larger
of their two scales (``ops.scaled_fp8_quant`` with a static scale: divide, clamp to ±448, round to e4m3). The
weights the base GEMM multiplies are those fp8 values times their scale.

Activations (the decoder, :func:`quantize_per_token`): the base experts multiply fp8 activations, each token's
(and, for ``w2``, each (token, choice) row's) own dynamic scale ``max|x| / 448`` (vLLM's ``per_act_token_quant``
in ``moe_kernel_quantize_input``). vLLM's ``fp8`` method with per-tensor weights takes one dynamic scale per batch
instead, which makes a request's numbers depend on its neighbours; a per-token scale keeps a correct target's
base requests independent of the batch, which base-request invariance needs. LoRA reads the activations
*unquantized*: ``TritonExperts.apply`` (``…/fused_moe/experts/triton_moe.py``) hands the LoRA shrink the
hidden states before quantization (``lora_x``) and, for ``w2``, ``intermediate_cache2`` (the activation's output
before ``moe_kernel_quantize_input``), the fix of vllm#42007/#42008, which had LoRA read quantized activations
without their scale.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# vLLM's dynamic per-token quantization floors the scale (csrc: MIN_SCALING_FACTOR = 1 / (448 · 512))
MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)


def to_e4m3(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values / scale`` clamped to ±448 and rounded to ``float8_e4m3fn`` (``scaled_fp8_quant``, static scale)."""
    return (values / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``per_tensor_dequantize``: the fp8 values as float16, times the scale (float16, as vLLM computes it)."""
    return quantized.to(torch.float16) * scale


def dequantize_experts(w1, s1, w3, s3, w2, s2) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's fused gate/up ``[2I, H]`` and down ``[H, I]`` weights (float32) as vLLM's fp8 MoE kernel
    multiplies them: ``w1`` and ``w3`` requantized with ``max(s1, s3)``, ``w2`` with its own scale."""
    s13 = torch.maximum(s1, s3)
    w13 = torch.cat([to_e4m3(dequantize(w1, s1), s13), to_e4m3(dequantize(w3, s3), s13)])
    return w13.to(torch.float32) * s13, w2.to(torch.float32) * s2


def quantize_per_token(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the base expert GEMM sees it: each row rounded to e4m3 with its own dynamic scale and multiplied
    back (in ``compute_dtype``), returned in ``x``'s dtype."""
    wide = x.to(compute_dtype)
    scale = (wide.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE)
    return (to_e4m3(wide, scale).to(compute_dtype) * scale).to(x.dtype)
