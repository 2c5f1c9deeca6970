"""``FullTargetExample``: vLLM's LoRA wrapper methods written directly, as a backend that has no Punica kernels.

A backend whose LoRA lives in its own layers (a fused graph, a compiler, a framework that never
exposes a bgmv or a sgmv) starts here: it subclasses the suite's plain ``Target`` and defines
``update_metadata`` and the wrapper methods vLLM's LoRA layers call, with vLLM's names, argument order
and defaults. The suite calls them as vLLM's layers do and judges every output. This example writes
the five dense methods in plain torch, one adapter slot at a time:

    add_shrink:  y[s][t]              += scale · x[t] @ A_s[l]ᵀ              float32 buffer, summed in float32
    add_expand:  y[t, cols_s]          (+)= round_w(round_w(x[s][t]) @ B_s[l]ᵀ)   (+ bias_s[l], unscaled)
    add_lora_linear:  add_shrink into a zeroed float32 buffer, then add_expand
    add_lora_embedding:  y[t] (+)= round_w(x[t] @ B[l]ᵀ)                     x: the LoRA-A rows the layer looked up
    add_lora_logits:  add_shrink then add_expand over the sampled rows, with their slots

for every row ``t`` whose slot ``l`` is not −1 (``round_w``: to the weight dtype, as vLLM's Triton
kernels round); rows of slot −1 and columns outside a slice are never written. It leaves out
``apply_lora_full_linear``, ``token_classification_head`` and the MoE methods: the suite reports
their cases "not supported", and its tensor-parallel layers run on the dense methods it has.
"""

from __future__ import annotations

import torch

from conformance.targets import Target

NO_ADAPTER = -1


def as_3d(stack: torch.Tensor) -> torch.Tensor:
    """A weight stack as ``[L, rows, cols]``; vLLM's layers pass ``[L, 1, rows, cols]``."""
    return stack[:, 0] if stack.ndim == 4 else stack


def rows_of_each_slot(slots: torch.Tensor, num_slots: int):
    """``(slot, rows)`` for every slot some row uses; slot −1 (no adapter) never."""
    for slot in range(num_slots):
        rows = torch.nonzero(slots == slot, as_tuple=True)[0]
        if rows.numel():
            yield slot, rows


class FullTargetExample(Target):
    name = "full-target-example"
    description = "example backend: vLLM's dense LoRA wrapper methods written directly in plain torch (no kernel ops)"
    why_not_implemented = {
        op: f"the example implements the five dense wrapper methods only; {op} is left out on purpose"
        for op in ("apply_lora_full_linear", "token_classification_head", "add_lora_w13", "add_lora_w2")
    }

    def update_metadata(self, mapping) -> None:
        """The batch: a slot per token and per sampled row (−1: no adapter), and how many slots there are."""
        self.token_slots = torch.tensor(mapping.token_slots, dtype=torch.long, device=self.device)
        self.sampled_slots = torch.tensor(mapping.sampled_slots, dtype=torch.long, device=self.device)
        self.num_slots = mapping.num_slots

    # -- the two products every method is made of ----------------------------------------------

    def _shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, scale: float, slots: torch.Tensor) -> None:
        lora_a = as_3d(lora_a)
        rank = lora_a.size(1)
        for slot, rows in rows_of_each_slot(slots, self.num_slots):
            product = x[rows].float() @ lora_a[slot].float().T
            y[rows, :rank] = (y[rows, :rank].float() + scale * product).to(y.dtype)

    def _expand(self, y: torch.Tensor, x: torch.Tensor, lora_b: torch.Tensor, column: int, add_inputs: bool,
                slots: torch.Tensor) -> None:
        lora_b = as_3d(lora_b)
        columns = slice(column, column + lora_b.size(1))
        for slot, rows in rows_of_each_slot(slots, self.num_slots):
            delta = (x[rows].to(lora_b.dtype).float() @ lora_b[slot].float().T).to(lora_b.dtype)
            base = y[rows, columns].float() if add_inputs else 0.0
            y[rows, columns] = (base + delta.float()).to(y.dtype)

    # -- vLLM's wrapper methods ---------------------------------------------------------------

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs) -> None:
        x = x.reshape(-1, x.size(-1))
        for s, lora_a in enumerate(lora_a_stacked):
            self._shrink(y[s], x, lora_a, scale, self.token_slots)

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, *,
                   lora_bias_stacked=None, **kwargs) -> None:
        y2d = y.view(-1, y.size(-1))
        column = offset_start
        for s, (lora_b, width) in enumerate(zip(lora_b_stacked, output_slices, strict=True)):
            self._expand(y2d, x[s], lora_b, column, add_inputs, self.token_slots)
            bias = lora_bias_stacked[s] if lora_bias_stacked is not None else None
            if bias is not None:  # after the product, unscaled, on the rows with an adapter
                bias = bias.reshape(bias.size(0), -1)
                for slot, rows in rows_of_each_slot(self.token_slots, self.num_slots):
                    cols = slice(column, column + width)
                    y2d[rows, cols] = (y2d[rows, cols].float() + bias[slot].float()).to(y2d.dtype)
            column += width

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                        lora_bias_stacked=None, add_inputs=True, **kwargs) -> None:
        x = x.reshape(-1, x.size(-1))
        if buffer is None:
            rank = as_3d(lora_b_stacked[0]).size(-1)
            buffer = torch.zeros(len(output_slices), x.size(0), rank, dtype=torch.float32, device=x.device)
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, 0, add_inputs, lora_bias_stacked=lora_bias_stacked)

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs) -> None:
        self._expand(y.view(-1, y.size(-1)), x, lora_b_stacked, 0, add_inputs, self.token_slots)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs) -> None:
        y2d, x = y.view(-1, y.size(-1)), x.reshape(-1, x.size(-1))
        rank = as_3d(lora_b_stacked).size(-1)
        buffer = torch.zeros(x.size(0), rank, dtype=torch.float32, device=x.device) if buffer is None else buffer.view(x.size(0), -1)
        self._shrink(buffer, x, lora_a_stacked, scale, self.sampled_slots)
        self._expand(y2d, buffer, lora_b_stacked, 0, True, self.sampled_slots)
