"""``FixedPunicaWrapperCPU``: vLLM's ``PunicaWrapperCPU`` with its known LoRA deviations fixed.

vLLM 0.32's CPU wrapper (read in ``vllm/lora/punica_wrapper/punica_cpu.py`` and
``vllm/lora/ops/torch_ops``) deviates from the LoRA contract in two ways the suite's ``cpu`` target
lists as known failures (``conformance/expectations/cpu.toml``):

* rows without an adapter (slot −1) get the last slot's delta: the torch ops index the weight stack
  with the slot, and −1 wraps around;
* ``add_lora_linear(..., add_inputs=False)`` raises: it hands ``add_inputs=True`` *and* the caller's
  ``**kwargs`` to ``add_expand`` (vLLM's GPU wrapper honours ``add_inputs``).

This subclass overrides the four methods that reach the torch ops (``add_shrink``, ``add_expand``,
``add_lora_embedding``, ``add_lora_logits``) with plain torch over one slot per row, taken from the
metadata ``PunicaWrapperBase.update_metadata`` keeps (``token_lora_indices`` for the tokens,
``sampler_indices`` for the sampled rows), and ``add_lora_linear`` to honour ``add_inputs``. The
rest is ``PunicaWrapperCPU``'s: construction, metadata, ``apply_lora_full_linear`` (whose row pick
already leaves rows of slot −1 alone). The math, for a row ``t`` of slot ``l ≠ −1``:

    shrink:  y[t, :R]          += scale · x[t] @ A[l]ᵀ           summed in float32
    expand:  y[t, off:off+N]    = (y[t, off:off+N] if add_inputs else 0) + round_w(round_w(x[t]) @ B[l]ᵀ)

with ``round_w`` a rounding to the weights' dtype, as vLLM's Triton kernels round; rows of slot −1 are
never written.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

NO_ADAPTER = -1


def _as_3d(stack: torch.Tensor) -> torch.Tensor:
    """A weight stack as ``[L, rows, cols]``; vLLM's layers hand ``[L, 1, rows, cols]``."""
    return stack[:, 0] if stack.ndim == 4 else stack


def _rows_per_slot(slots: torch.Tensor):
    """``(slot, row indices)`` for each slot some row uses; slot −1 (no adapter) never."""
    for slot in torch.unique(slots).tolist():
        if slot != NO_ADAPTER:
            yield slot, torch.nonzero(slots == slot, as_tuple=True)[0]


def shrink_rows(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    """``y[t] += scale · x[t] @ A[slot_t]ᵀ`` for the rows of a slot, in float32, written back in ``y``'s dtype."""
    lora_a = _as_3d(lora_a)
    for slot, rows in _rows_per_slot(slots):
        product = x[rows].float() @ lora_a[slot].float().T
        y[rows] = (y[rows].float() + scale * product).to(y.dtype)


def expand_rows(y: torch.Tensor, x: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, offset: int,
                add_inputs: bool) -> None:
    """``y[t, offset:offset+N] (+)= round_w(round_w(x[t]) @ B[slot_t]ᵀ)`` for the rows of a slot; nothing else written."""
    lora_b = _as_3d(lora_b)
    columns = slice(offset, offset + lora_b.size(1))
    for slot, rows in _rows_per_slot(slots):
        delta = (x[rows].to(lora_b.dtype).float() @ lora_b[slot].float().T).to(lora_b.dtype)
        base = y[rows, columns].float() if add_inputs else 0.0
        y[rows, columns] = (base + delta.float()).to(y.dtype)


class FixedPunicaWrapperCPU(PunicaWrapperCPU):
    """``PunicaWrapperCPU`` whose LoRA methods leave rows without an adapter alone and honour ``add_inputs``."""

    def add_shrink(self, y, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float, **kwargs: Any) -> None:
        x = x.view(-1, x.shape[-1])
        slots = self.token_lora_indices
        for index, lora_a in enumerate(lora_a_stacked):
            shrink_rows(y[index], x, lora_a, slots, scale)

    def add_expand(self, y: torch.Tensor, x, lora_b_stacked: tuple[torch.Tensor, ...], output_slices: tuple[int, ...],
                   offset_start: int = 0, add_inputs: bool = True, **kwargs: Any) -> None:
        y2d = y.view(-1, y.shape[-1])
        slots = self.token_lora_indices
        offset = offset_start
        for index, lora_b in enumerate(lora_b_stacked):
            expand_rows(y2d, x[index], lora_b, slots, offset, add_inputs)
            offset += output_slices[index]

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool = True,
                           **kwargs: Any) -> None:
        expand_rows(y.view(-1, y.shape[-1]), x, lora_b_stacked, self.token_lora_indices, 0, add_inputs)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...], *,
                        buffer: tuple[torch.Tensor, ...] | None = None, add_inputs: bool = True, **kwargs: Any) -> None:
        # add_inputs is a parameter here, not left in **kwargs: add_inputs=False writes the LoRA output alone.
        x = x.view(-1, x.shape[-1])
        if buffer is None:  # float32, as vLLM's wrappers make it
            rank = lora_b_stacked[0].size(-1)
            buffer = tuple(torch.zeros((x.size(0), rank), dtype=torch.float32, device=x.device) for _ in output_slices)
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, add_inputs=add_inputs)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor, lora_b_stacked: torch.Tensor,
                        scale: float, *, buffer: torch.Tensor | None = None, **kwargs: Any) -> None:
        y2d, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        slots = self.sampler_indices  # one per sampled row
        if buffer is None:
            buffer = torch.zeros((x.size(0), lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
        shrink_rows(buffer, x, lora_a_stacked, slots, scale)
        expand_rows(y2d, buffer, lora_b_stacked, slots, 0, add_inputs=True)
