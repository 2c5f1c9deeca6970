"""Which weights each slice of a packed layer holds for one adapter: vLLM 0.34's ``set_lora`` of packed layers.

A packed layer (``qkv_proj``: q, k, v; ``in_proj_qkvz`` …) keeps one LoRA stack per output slice. When an
adapter is set, each slice gets the weights of the sub-module it is packed from:

* **a per-layer override** (vLLM 0.34, ``LoRAModelManager._register_packed_modules`` reads a base layer's
  ``lora_packed_modules`` before the model's leaf-name mapping): Gemma 4's full-attention ``k_eq_v`` layers
  pack ``[q_proj, k_proj, k_proj]``, so the v slice holds k_proj's LoRA (``repeated[s]``: the slice whose
  sub-module slice ``s`` holds);
* **a partially packed adapter** (vLLM 0.34, ``MergedColumnParallelLinearWithLoRA.expand_packed_lora``):
  an adapter without some of the sub-modules (a None group) leaves those slices at zero (``reset_lora``),
  base weights only, and fills the others from its own.

So for slot ``l`` and slice ``s``: ``A_s[l] = A_{repeated[s]}[l]`` and ``B_s[l] = B_{repeated[s]}[l]``, or
zero where ``(l, s)`` is absent. Nothing else of the op changes: ``add_lora_linear`` over these stacks.
"""

from __future__ import annotations

import torch


def fill_packed_slices(stacks: list[torch.Tensor], absent: tuple[tuple[int, int], ...], repeated: tuple[int, ...]) -> list[torch.Tensor]:
    """The per-slice stacks (``[L, …]``, one per slice) as ``set_lora`` leaves them: new tensors, slice
    ``s`` holding slice ``repeated[s]``'s weights (``()``: its own), zero for every ``(slot, slice)`` in ``absent``."""
    filled = [stacks[source].clone() for source in (repeated or range(len(stacks)))]
    for slot, s in absent:
        filled[s][slot] = 0
    return filled
