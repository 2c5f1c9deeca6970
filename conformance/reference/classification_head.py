"""A whole per-adapter classification head (PEFT ``modules_to_save``) replacing the rows it serves.

vLLM runs such heads in two layers, which compute the same thing over different rows:

* the *sequence* head (``ClassificationHeadWithLoRA``, vLLM ≥ 0.32): one row per request, through the
  wrapper method ``apply_lora_full_linear``, its rows the sampled rows;
* the *token* head (``TokenClassificationHeadWithLoRA``, vLLM 0.33.0, ``vllm/lora/layers/classifier.py``):
  one row per token. PunicaWrapper has no method for it: the layer shrinks the whole head weight
  ``[L, 1, P, H]`` at scale 1 into a zeroed float32 ``[1, T, P]`` buffer with ``add_shrink`` (the "rank"
  is the padded label count ``P``, any width), adds the bias, and keeps a row's result only where its
  ``token_lora_indices`` entry is ≥ 0 and that slot's ``full_module_enabled`` is set, the base output
  everywhere else (``torch.where``).

For a row ``r`` of slot ``l ≠ −1`` whose head is enabled::

    y[r] = x[r] @ W[l]ᵀ + bias[l]

computed in float32 (float64 for the oracle) and rounded once to ``y``'s dtype: the row is *replaced*.
Rows of slot −1 and rows whose slot has no head stay bit-identical, whatever the stacks hold for them.
"""

from __future__ import annotations

import torch

from ._grouping import rows_per_adapter
from ._stacks import accumulation_dtype, weight_stack


def replace_rows_with_head(
    y: torch.Tensor,
    x: torch.Tensor,
    weight_stacked: torch.Tensor,
    bias_stacked: torch.Tensor | None,
    module_enabled: torch.Tensor,
    row_slots: torch.Tensor,
) -> None:
    """``y[r] = x[r] @ W[l]ᵀ + bias[l]`` for every row ``r`` of an enabled slot ``l``; the other rows untouched.

    ``y`` ``[rows, P]``, ``x`` ``[rows, H]``, ``W`` ``[L, (1,) P, H]``, ``bias`` ``[L, P]`` (``None``: no
    bias), ``module_enabled`` bool ``[L]``, ``row_slots`` one slot per row (−1: none).
    """
    weights = weight_stack(weight_stacked)  # [L, P, H]
    if y.size(0) != x.size(0) or weights.size(1) != y.size(1):
        raise ValueError(f"y {tuple(y.shape)} does not fit x {tuple(x.shape)} and the weights {tuple(weights.shape)}")
    if row_slots.numel() != y.size(0):
        raise ValueError(f"{row_slots.numel()} row slots for {y.size(0)} rows")
    enabled = module_enabled.reshape(-1).bool().tolist()
    biases = None if bias_stacked is None else bias_stacked.reshape(bias_stacked.size(0), -1)
    acc = accumulation_dtype(x, weights)
    for slot, rows in rows_per_adapter(row_slots):
        if not enabled[slot]:
            continue  # an adapter without a saved head: its rows keep the base classifier's output
        result = x[rows].to(acc) @ weights[slot].to(acc).T
        if biases is not None:
            result = result + biases[slot].to(acc)  # added before the one rounding to y's dtype
        y[rows] = result.to(y.dtype)
