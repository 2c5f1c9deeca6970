"""vLLM's classification-head LoRA layers, as the layers compute them over a target's wrapper methods.

A whole per-adapter head (PEFT ``modules_to_save``) *replaces* the rows it serves; the layer, not a
kernel, decides which rows those are (``conformance/reference/classification_head.py`` is the oracle):

* :func:`pick_head_rows`: the pick both vLLM heads end with: a row keeps ``product + bias[slot]`` where
  its slot is ≥ 0 and that slot's head is enabled, and its base output everywhere else (``torch.where``),
  rounded once from float32;
* :class:`TokenHeadFromShrink`: ``token_classification_head``, vLLM 0.33's
  ``TokenClassificationHeadWithLoRA`` (``vllm/lora/layers/classifier.py``): the whole head weight
  ``[L, 1, P, H]`` shrunk at scale 1 into a zeroed float32 ``[1, T, P]`` buffer by the target's own
  ``add_shrink`` (the padded label count ``P`` as the "rank"), then the pick over the tokens' slots.
  PunicaWrapper has no such method: every target with ``add_shrink`` gets it from this mixin, so its
  ``add_shrink`` is judged at the head's widths and its pick with it.
"""

from __future__ import annotations

import torch


def pick_head_rows(y: torch.Tensor, product: torch.Tensor, bias_stacked: torch.Tensor | None, module_enabled: torch.Tensor,
                   row_slots: torch.Tensor) -> None:
    """``y[r] = product[r] + bias[slot_r]`` for rows whose slot is ≥ 0 with an enabled head; the others keep ``y[r]``.

    ``y`` ``[rows, P]`` (the base output), ``product`` float32 ``[rows, P]`` (``x @ W[slot]ᵀ``), ``bias``
    ``[L, P]`` or None, ``module_enabled`` bool ``[L]``, ``row_slots`` one slot per row (−1: no adapter).
    """
    slots = row_slots.to(y.device).long()
    safe = slots.clamp(min=0)  # a −1 row reads slot 0 here and is discarded by the where below
    served = (slots >= 0) & module_enabled.to(y.device).bool()[safe]
    if bias_stacked is not None:
        product = product + bias_stacked.reshape(bias_stacked.size(0), -1)[safe].to(product.dtype)
    y.copy_(torch.where(served[:, None], product.to(y.dtype), y))


class TokenHeadFromShrink:
    """``token_classification_head`` from the target's ``add_shrink`` and its tokens' slots (``token_lora_slots``)."""

    def token_lora_slots(self) -> torch.Tensor:
        """One slot per token of the current batch (−1: no adapter), as the target's metadata holds them."""
        raise NotImplementedError

    def token_classification_head(self, y: torch.Tensor, x: torch.Tensor, weight_stacked: torch.Tensor,
                                  bias_stacked: torch.Tensor | None, module_enabled: torch.Tensor) -> None:
        """``y[t] = x[t] @ W[slot_t]ᵀ + bias[slot_t]`` for tokens of a slot with an enabled head; the row is replaced."""
        x = x.reshape(-1, x.size(-1))
        product = torch.zeros(1, x.size(0), weight_stacked.size(-2), dtype=torch.float32, device=x.device)
        self.add_shrink(product, x, (weight_stacked,), 1.0)
        pick_head_rows(y.view(-1, y.size(-1)), product[0], bias_stacked, module_enabled, self.token_lora_slots())
