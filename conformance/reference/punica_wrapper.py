"""The reference PunicaWrapper: vLLM's wrapper methods composed from ``lora_shrink`` / ``lora_expand``.

Method names, argument names and argument order are vLLM's (``PunicaWrapperBase``), with LoRA bias as
the optional keyword ``lora_bias_stacked``. ``update_metadata`` takes the suite's slot-based
``LoRAMapping``. Semantics, for a row ``t`` of slot ``l ≠ −1`` (rows of slot −1 are never written):

* ``add_shrink``:  ``y[s, t] += scale · x[t] @ A_s[l]ᵀ``
* ``add_expand``:  ``y[t, cols_s] = (y[t, cols_s] if add_inputs else 0) + x[s, t] @ B_s[l]ᵀ + bias_s[l]``
  with ``cols_s`` starting at ``offset_start + Σ_{j<s} N_j``; the bias is not scaled and follows
  ``offset_start`` like the LoRA delta does;
* ``add_lora_linear``: ``add_shrink`` into a zeroed float32 buffer, then ``add_expand(add_inputs=True)``;
* ``add_lora_embedding``: ``y[t] (+)= x[t] @ B[l]ᵀ`` (``x`` holds the LoRA-A rows already looked up);
* ``add_lora_logits``: ``add_lora_linear`` for one slice, indexed by the sampled rows' slots.
"""

from __future__ import annotations

import torch

from ._grouping import rows_per_adapter
from ._stacks import accumulation_dtype, weight_stack
from .kernel_meta import LoRAKernelMeta
from .mapping import LoRAMapping
from .op_lora_expand import lora_expand
from .op_lora_shrink import lora_shrink


class PunicaWrapperReference:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.mapping: LoRAMapping | None = None
        self.token_meta: LoRAKernelMeta | None = None  # set by update_metadata; _meta refuses None
        self.sampled_meta: LoRAKernelMeta | None = None

    def update_metadata(self, mapping: LoRAMapping) -> None:
        self.mapping = mapping
        self.token_meta = LoRAKernelMeta.build(mapping.token_slot_tensor(), mapping.num_slots).to(self.device)
        self.sampled_meta = LoRAKernelMeta.build(mapping.sampled_slot_tensor(), mapping.num_slots).to(self.device)

    def _meta(self, meta: LoRAKernelMeta, rows: int) -> tuple[torch.Tensor, ...]:
        if self.mapping is None:
            raise RuntimeError("update_metadata(mapping) must be called before the wrapper methods")
        if meta.token_lora_mapping.numel() != rows:
            raise ValueError(f"the mapping describes {meta.token_lora_mapping.numel()} rows, the input has {rows}")
        return meta.meta_args()

    def add_shrink(self, y, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float, **kwargs) -> None:
        x = x.reshape(-1, x.size(-1))
        lora_shrink(x, list(lora_a_stacked), y, *self._meta(self.token_meta, x.size(0)), scale)

    def add_expand(
        self,
        y: torch.Tensor,
        x,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        *,
        lora_bias_stacked: tuple[torch.Tensor | None, ...] | None = None,
        **kwargs,
    ) -> None:
        y2d = y.view(-1, y.size(-1))
        x = torch.stack(tuple(x)) if isinstance(x, (tuple, list)) else x
        self._check_slices(lora_b_stacked, output_slices)
        lora_expand(x, list(lora_b_stacked), y2d, *self._meta(self.token_meta, y2d.size(0)), offset_start, add_inputs)
        if lora_bias_stacked is not None:
            self._add_bias(y2d, lora_bias_stacked, output_slices, offset_start)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool = True, **kwargs) -> None:
        y2d = y.view(-1, y.size(-1))
        lora_expand(x.unsqueeze(0), [lora_b_stacked], y2d, *self._meta(self.token_meta, y2d.size(0)), 0, add_inputs)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: torch.Tensor | None = None,
        lora_bias_stacked: tuple[torch.Tensor | None, ...] | None = None,
        **kwargs,
    ) -> None:
        x = x.reshape(-1, x.size(-1))
        if buffer is None:
            buffer = self._shrink_buffer(len(lora_a_stacked), x, lora_a_stacked[0])
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, 0, True, lora_bias_stacked=lora_bias_stacked)

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        y2d = y.view(-1, y.size(-1))
        x = x.reshape(-1, x.size(-1))
        meta = self._meta(self.sampled_meta, x.size(0))
        if buffer is None:
            buffer = self._shrink_buffer(1, x, lora_a_stacked)
        buffer = buffer.view(1, x.size(0), -1)
        lora_shrink(x, [lora_a_stacked], buffer, *meta, scale)
        lora_expand(buffer, [lora_b_stacked], y2d, *meta, 0, True)

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _shrink_buffer(num_slices: int, x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
        """A zeroed buffer in the accumulation dtype (float32; float64 for the oracle)."""
        rank = weight_stack(lora_a).size(1)
        return torch.zeros(num_slices, x.size(0), rank, dtype=accumulation_dtype(x, lora_a), device=x.device)

    @staticmethod
    def _check_slices(lora_b_stacked, output_slices) -> None:
        widths = tuple(weight_stack(b).size(1) for b in lora_b_stacked)
        if widths != tuple(output_slices):
            raise ValueError(f"output_slices {tuple(output_slices)} differ from the LoRA-B widths {widths}")

    def _add_bias(self, y: torch.Tensor, lora_bias_stacked, output_slices, offset_start: int) -> None:
        """``y[t, cols_s] += bias_s[l]`` for rows of slot ``l ≠ −1``; the bias is not scaled."""
        column = offset_start
        for bias, width in zip(lora_bias_stacked, output_slices, strict=True):
            if bias is not None:
                bias2d = bias.reshape(bias.size(0), -1)  # [L, N_s]
                acc = accumulation_dtype(y, bias2d)
                for slot, rows in rows_per_adapter(self.mapping.token_slot_tensor()):
                    cols = slice(column, column + width)
                    y[rows, cols] = (y[rows, cols].to(acc) + bias2d[slot].to(acc)).to(y.dtype)
            column += width
