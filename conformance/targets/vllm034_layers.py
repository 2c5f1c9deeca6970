"""vLLM 0.34's LoRA layers whose code is more than one wrapper call, over a target's own wrapper methods.

Like :class:`~conformance.targets.classification_head.TokenHeadFromShrink`, this is the layer's code as vLLM
0.34 writes it, not a PunicaWrapper method: every target with the wrapper methods it calls gets the op from
this mixin, so those methods are judged at the layer's shapes and calls (the oracle is
``conformance/reference/grouped_lora.py``, ``fp32_output.py`` and ``embed_scale.py``):

* ``grouped_lora_linear``: ``DeepseekV4GroupedWoAWithLoRA.grouped_forward`` (``vllm/lora/layers/custom_layer.py``):
  for each head group, ``add_lora_linear`` on a contiguous copy of the group's input and output columns with the
  shared LoRA-A and the group's LoRA-B, the result copied back;
* ``fp32_output_lora_linear``: ``DeepseekV4CompressorKVScoreWithLoRA.apply``: ``add_lora_linear`` into a zeroed
  buffer of the LoRA-B dtype, added to the float32 output;
* ``scaled_embedding_lora``: ``VocabParallelEmbeddingWithLoRA.set_lora`` folds ``embed_scale`` into LoRA-B (in the
  stack's dtype, rounded once; here into a copy, as an op must not change what it is handed), then
  ``add_lora_embedding``.

Each is a composition of shape-static tensor ops and wrapper calls: no host sync of its own.
"""

from __future__ import annotations

import torch

# Where each op's layer lives in vLLM 0.34, for the reasons a target on an older vLLM gives.
VLLM_034_LAYERS = {
    "grouped_lora_linear": "DeepseekV4GroupedWoAWithLoRA (vllm/lora/layers/custom_layer.py)",
    "fp32_output_lora_linear": "DeepseekV4CompressorKVScoreWithLoRA (vllm/lora/layers/custom_layer.py)",
    "scaled_embedding_lora": "VocabParallelEmbeddingWithLoRA.set_lora folding embed_scale (vllm/lora/layers/vocab_parallel_embedding.py)",
}


class Vllm034Layers:
    """The three layer ops from ``self.add_lora_linear`` and ``self.add_lora_embedding``."""

    def grouped_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                            lora_b_stacked: tuple[torch.Tensor, ...], scale: float) -> None:
        """``y[t, g] += scale · (x[t, g] @ A[l]ᵀ) @ B_g[l]ᵀ``, ``x`` ``[T, G, H]``, ``y`` ``[T, G, N]``."""
        for group, lora_b in enumerate(lora_b_stacked):
            group_output = y[:, group].contiguous()
            self.add_lora_linear(group_output, x[:, group].contiguous(), (lora_a_stacked,), (lora_b,), scale, (y.size(-1),))
            y[:, group] = group_output

    def fp32_output_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                                lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...]) -> None:
        """``y += delta``, the delta built by ``add_lora_linear`` in a zeroed buffer of LoRA-B's dtype."""
        delta = torch.zeros_like(y, dtype=lora_b_stacked[0].dtype)
        self.add_lora_linear(delta, x, lora_a_stacked, lora_b_stacked, scale, output_slices)
        y.add_(delta)

    def scaled_embedding_lora(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, embed_scale: float | None,
                              add_inputs: bool = True) -> None:
        """``y[t] (+)= x[t] @ (embed_scale · B[l])ᵀ``: the scale folded into a copy of LoRA-B, then ``add_lora_embedding``."""
        if embed_scale is not None:
            lora_b_stacked = lora_b_stacked.clone().mul_(embed_scale)
        self.add_lora_embedding(y, x, lora_b_stacked, add_inputs)
