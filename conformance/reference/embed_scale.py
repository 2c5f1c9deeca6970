"""An embedding's ``embed_scale`` folded into LoRA-B: vLLM 0.34's ``VocabParallelEmbeddingWithLoRA.set_lora``.

A scaled embedding (a Transformers ``*ScaledWordEmbedding``: Gemma's ``√hidden``) multiplies its lookup by
``embed_scale`` in its forward, and PEFT multiplies the LoRA delta by the same factor. vLLM 0.34
(``vllm/lora/layers/vocab_parallel_embedding.py``, ``set_lora``) folds it into the adapter's LoRA-B once,
when the adapter is set (``lora_b_stacked[index].mul_(embed_scale)``), and the forward is the plain
``add_lora_embedding``. For a token ``t`` of slot ``l ≠ −1`` (``x[t]`` its looked-up LoRA-A row)::

    y[t] (+)= x[t] @ (embed_scale · B[l])ᵀ

The scale is applied exactly once; ``embed_scale`` None (an embedding without one) folds nothing.
"""

from __future__ import annotations

import torch


def fold_embed_scale(lora_b_stacked: torch.Tensor, embed_scale: float | None) -> torch.Tensor:
    """``embed_scale · B`` in B's dtype (rounded once, as the in-place ``mul_`` of ``set_lora``); a new tensor."""
    if embed_scale is None:
        return lora_b_stacked
    return (lora_b_stacked.double() * embed_scale).to(lora_b_stacked.dtype)
