"""``KernelTarget``: the wrapper methods derived from a vendor's kernel ops, composed as vLLM does.

A vendor who implements only kernels subclasses :class:`KernelTarget`, defines its kernel ops as
methods (or staticmethods) with the suite's signatures, and ``default_device`` when its tensors do
not live on the CPU. The base supplies ``update_metadata`` and every wrapper method. Two
compositions exist, both vLLM's:

* **lora** (vLLM's ``PunicaWrapperGPU``): ``lora_shrink`` / ``lora_expand`` fed by
  ``LoRAKernelMeta`` built for the tokens (linear, embedding) and for the sampled rows (logits);
* **classic** (vLLM's ``PunicaWrapperCPU``): a prefill batch goes to the sgmv ops with
  ``SegmentMetadata`` (runs of equal slots; nothing is launched when every token has slot −1), a
  decode batch to the bgmv ops with one slot per token; the logits always go to the bgmv ops with one
  slot per sampled row; slices are expanded one by one with the ``*_expand_slice`` op at a running
  column offset that starts at ``offset_start``.

Which kernels each wrapper op needs (a wrapper op whose kernels are missing is not implemented, so
the runner reports its cases "not supported"):

====================  ===========================  ===============================================
wrapper op            lora composition             classic composition
====================  ===========================  ===============================================
add_shrink            lora_shrink                  sgmv_shrink and bgmv_shrink
add_expand            lora_expand                  sgmv_expand_slice and bgmv_expand_slice
add_lora_embedding    lora_expand                  sgmv_expand and bgmv_expand
add_lora_logits       lora_shrink and lora_expand  bgmv_shrink and bgmv_expand
add_lora_linear       ``add_shrink`` then ``add_expand`` (each by whichever composition it has)
====================  ===========================  ===============================================

Each of the first four uses the first composition in ``wrapper_paths`` (``("lora", "classic")``
unless a subclass says otherwise) whose kernels are all present. A wrapper method the subclass
defines itself always wins and counts as implemented (set it to ``None`` to opt out of one);
``add_lora_linear`` calls ``self.add_shrink`` and ``self.add_expand``, so it composes from
overridden ones too.

Where vLLM's wrappers disagree with each other, the suite's semantics (``conformance.reference``)
decide, and so does this base:

* ``add_inputs`` of ``add_expand`` is honoured (vLLM's GPU wrapper always accumulates);
* LoRA bias (``lora_bias_stacked``) is added after the LoRA-B product, unscaled, to the rows whose
  slot is not −1, in the columns of its slice counted from ``offset_start`` (vLLM's ``_apply_bias``
  starts at column 0 and runs before the expand, which then overwrites it when ``add_inputs=False``);
* ``add_lora_linear`` and ``add_lora_logits`` shrink into a zeroed float32 buffer of the LoRA-B rank
  when the caller passes ``buffer=None`` (a caller's buffer must be zeroed, as in vLLM).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from conformance.ops import Level, ops_at
from conformance.reference import LoRAKernelMeta, LoRAMapping, SegmentMetadata

from .base import Target

KERNELS_NEEDED: dict[str, dict[str, tuple[str, ...]]] = {
    "lora": {
        "add_shrink": ("lora_shrink",),
        "add_expand": ("lora_expand",),
        "add_lora_embedding": ("lora_expand",),
        "add_lora_logits": ("lora_shrink", "lora_expand"),
    },
    "classic": {
        "add_shrink": ("sgmv_shrink", "bgmv_shrink"),
        "add_expand": ("sgmv_expand_slice", "bgmv_expand_slice"),
        "add_lora_embedding": ("sgmv_expand", "bgmv_expand"),
        "add_lora_logits": ("bgmv_shrink", "bgmv_expand"),
    },
}
"""Per composition, the kernels each kernel-backed wrapper op calls."""

COMPOSED_OF: dict[str, tuple[str, ...]] = {"add_lora_linear": ("add_shrink", "add_expand")}
"""Wrapper ops built from other wrapper methods rather than from kernels."""


class KernelTarget(Target):
    """Base of targets that implement kernel ops only; see the module docstring.

    After ``update_metadata`` these attributes describe the batch, on ``self.device``:
    ``token_indices`` / ``sampled_indices`` (slot per token / per sampled row, int64),
    ``token_meta`` / ``sampled_meta`` (:class:`LoRAKernelMeta`), ``segments``
    (:class:`SegmentMetadata` of the tokens) and ``is_prefill``.
    """

    name = "kernel-ops"
    description = "wrapper methods derived from the kernel ops a subclass defines"
    wrapper_paths: ClassVar[tuple[str, ...]] = ("lora", "classic")

    def __init__(self) -> None:
        super().__init__()
        self.mapping: LoRAMapping | None = None

    # -- which ops exist -----------------------------------------------------------------------

    def kernel_ops(self) -> tuple[str, ...]:
        """The kernel ops this target defines."""
        return tuple(op for op in ops_at(Level.KERNEL) if callable(getattr(self, op, None)))

    def overrides(self, op: str) -> bool:
        """Whether the subclass (or the instance) defines wrapper method ``op`` itself."""
        return op in vars(self) or getattr(type(self), op) is not getattr(KernelTarget, op)

    def wrapper_path(self, op: str) -> str | None:
        """The composition a kernel-backed wrapper op uses: the first whose kernels are all present."""
        present = set(self.kernel_ops())
        for path in self.wrapper_paths:
            if set(KERNELS_NEEDED[path][op]) <= present:
                return path
        return None

    def wrapper_implemented(self, op: str) -> bool:
        if not callable(getattr(self, op, None)):  # a subclass opted out with ``op = None``
            return False
        if self.overrides(op):
            return True
        if op in COMPOSED_OF:
            return all(self.wrapper_implemented(part) for part in COMPOSED_OF[op])
        return self.wrapper_path(op) is not None

    def implemented_ops(self) -> tuple[str, ...]:
        return self.kernel_ops() + tuple(op for op in ops_at(Level.WRAPPER) if self.wrapper_implemented(op))

    def derived_from(self, op: str) -> tuple[str, ...]:
        """The kernel ops the derived wrapper method ``op`` calls (through its parts for ``add_lora_linear``);
        ``()`` when the subclass defines ``op`` itself or it is not implemented."""
        if not self.wrapper_implemented(op) or self.overrides(op):
            return ()
        if op in COMPOSED_OF:
            return tuple(dict.fromkeys(kernel for part in COMPOSED_OF[op] for kernel in self.derived_from(part)))
        return KERNELS_NEEDED[self.wrapper_path(op)][op]

    def _path(self, op: str) -> str:
        """``wrapper_path(op)``, or NotImplementedError naming the kernels that would make it work."""
        path = self.wrapper_path(op)
        if path is None:
            options = " or ".join(" and ".join(KERNELS_NEEDED[p][op]) for p in self.wrapper_paths)
            raise NotImplementedError(f"{self.name}: {op} needs {options}")
        return path

    # -- metadata ------------------------------------------------------------------------------

    def update_metadata(self, mapping: LoRAMapping) -> None:
        self.mapping = mapping
        self.is_prefill = mapping.is_prefill
        tokens, sampled = mapping.token_slot_tensor(), mapping.sampled_slot_tensor()
        self.token_indices = tokens.to(self.device)
        self.sampled_indices = sampled.to(self.device)
        self.token_meta = self.kernel_meta(tokens, mapping.num_slots)
        self.sampled_meta = self.kernel_meta(sampled, mapping.num_slots)
        self.segments = self.segment_meta(tokens)

    def kernel_meta(self, slots: torch.Tensor, num_slots: int) -> LoRAKernelMeta:
        """``lora_*`` metadata for one slot per row, on the device (the flag stays on the CPU)."""
        return LoRAKernelMeta.build(slots, num_slots).to(self.device)

    def segment_meta(self, slots: torch.Tensor) -> SegmentMetadata:
        """sgmv metadata (runs of equal slots) for one slot per token, on the device."""
        meta = SegmentMetadata.from_token_slots(slots)
        return dataclasses.replace(
            meta,
            b_seq_start_loc=meta.b_seq_start_loc.to(self.device),
            seq_len_tensor=meta.seq_len_tensor.to(self.device),
            lora_indices_tensor=meta.lora_indices_tensor.to(self.device),
        )

    def _meta_args(self, meta: LoRAKernelMeta, rows: int) -> tuple[torch.Tensor, ...]:
        """The six metadata tensors of ``lora_*`` ops, after checking they describe ``rows`` rows."""
        if self.mapping is None:
            raise RuntimeError("update_metadata(mapping) must be called before the wrapper methods")
        if meta.token_lora_mapping.numel() != rows:
            raise ValueError(f"the mapping describes {meta.token_lora_mapping.numel()} rows, the input has {rows}")
        return meta.meta_args()

    # -- wrapper methods -----------------------------------------------------------------------

    def add_shrink(self, y, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float, **kwargs) -> None:
        """``y[s] += scale · x @ A_s[slot]ᵀ`` for each slice ``s``."""
        x = x.reshape(-1, x.size(-1))
        if self._path("add_shrink") == "lora":
            self.lora_shrink(x, list(lora_a_stacked), y, *self._meta_args(self.token_meta, x.size(0)), scale)
            return
        for s, lora_a in enumerate(lora_a_stacked):
            self._classic_shrink(y[s], x, lora_a, scale)

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
        """``y[:, cols_s] (+)= x[s] @ B_s[slot]ᵀ (+ bias_s[slot])``, slices side by side from ``offset_start``."""
        y2d = y.view(-1, y.size(-1))
        _check_slices(lora_b_stacked, output_slices)
        if self._path("add_expand") == "lora":
            x = torch.stack(tuple(x)) if isinstance(x, (tuple, list)) else x
            meta = self._meta_args(self.token_meta, y2d.size(0))
            self.lora_expand(x, list(lora_b_stacked), y2d, *meta, offset_start, add_inputs)
        else:
            column = offset_start
            for s, (lora_b, width) in enumerate(zip(lora_b_stacked, output_slices, strict=True)):
                self._classic_expand_slice(y2d, x[s], lora_b, column, width, add_inputs)
                column += width
        if lora_bias_stacked is not None:
            self.apply_bias(y2d, lora_bias_stacked, output_slices, offset_start)

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
        """``add_shrink`` into a float32 buffer, then ``add_expand(add_inputs=True)`` with the bias."""
        if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices):
            raise ValueError("lora_a_stacked, lora_b_stacked and output_slices must have one entry per slice")
        x = x.reshape(-1, x.size(-1))
        if buffer is None:
            buffer = self.zero_buffer(len(output_slices), x.size(0), lora_b_stacked[0].size(-1))
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, 0, True, lora_bias_stacked=lora_bias_stacked)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool = True, **kwargs) -> None:
        """``y[t] (+)= x[t] @ B[slot_t]ᵀ``; ``x`` holds the LoRA-A rows the embedding layer looked up."""
        y2d = y.view(-1, y.size(-1))
        if self._path("add_lora_embedding") == "lora":
            meta = self._meta_args(self.token_meta, y2d.size(0))
            self.lora_expand(x.unsqueeze(0), [lora_b_stacked], y2d, *meta, 0, add_inputs)
        else:
            self._classic_expand(y2d, x, lora_b_stacked, add_inputs)

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
        """``y[p] += scale · (x[p] @ A[slot_p]ᵀ) @ B[slot_p]ᵀ`` with the slots of the sampled rows."""
        y2d = y.view(-1, y.size(-1))
        x = x.reshape(-1, x.size(-1))
        if buffer is None:
            buffer = self.zero_buffer(1, x.size(0), lora_b_stacked.size(-1))[0]
        buffer = buffer.view(x.size(0), -1)
        if self._path("add_lora_logits") == "lora":
            meta = self._meta_args(self.sampled_meta, x.size(0))
            self.lora_shrink(x, [lora_a_stacked], buffer.unsqueeze(0), *meta, scale)
            self.lora_expand(buffer.unsqueeze(0), [lora_b_stacked], y2d, *meta, 0, True)
        else:
            self.bgmv_shrink(x, lora_a_stacked, buffer, self.sampled_indices, scale)
            self.bgmv_expand(buffer, lora_b_stacked, y2d, self.sampled_indices, True)

    # -- the classic composition (vLLM's PunicaWrapperCPU) ---------------------------------------

    def _classic_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, scale: float) -> None:
        if not self.is_prefill:
            self.bgmv_shrink(x, lora_a, y, self.token_indices, scale)
        elif not self.segments.no_lora:
            self.sgmv_shrink(x, lora_a, y, *self.segments.args(), scale)

    def _classic_expand_slice(self, y, x, lora_b, offset: int, width: int, add_inputs: bool) -> None:
        if not self.is_prefill:
            self.bgmv_expand_slice(x, lora_b, y, self.token_indices, offset, width, add_inputs)
        elif not self.segments.no_lora:
            self.sgmv_expand_slice(x, lora_b, y, *self.segments.args(), offset, width, add_inputs)

    def _classic_expand(self, y, x, lora_b, add_inputs: bool) -> None:
        if not self.is_prefill:
            self.bgmv_expand(x, lora_b, y, self.token_indices, add_inputs)
        elif not self.segments.no_lora:
            self.sgmv_expand(x, lora_b, y, *self.segments.args(), add_inputs)

    # -- helpers a subclass may replace ----------------------------------------------------------

    def zero_buffer(self, num_slices: int, rows: int, rank: int) -> torch.Tensor:
        """The shrink output when the caller passes none: zeros, float32, ``[S, rows, rank]``."""
        return torch.zeros(num_slices, rows, rank, dtype=torch.float32, device=self.device)

    def apply_bias(self, y2d: torch.Tensor, lora_bias_stacked, output_slices, offset_start: int) -> None:
        """``y[t, cols_s] += bias_s[slot_t]`` for rows of slot ≠ −1; columns from ``offset_start``; unscaled."""
        rows = torch.nonzero(self.token_indices != -1).flatten()
        slots = self.token_indices[rows]
        column = offset_start
        for bias, width in zip(lora_bias_stacked, output_slices, strict=True):
            if bias is not None:
                per_row = bias.reshape(bias.size(0), -1)[slots]  # [rows, N_s]
                acc = torch.promote_types(y2d.dtype, torch.float32)
                cols = slice(column, column + width)
                y2d[rows, cols] = (y2d[rows, cols].to(acc) + per_row.to(acc)).to(y2d.dtype)
            column += width


def _check_slices(lora_b_stacked, output_slices) -> None:
    """The LoRA-B stacks' widths (dim −2) must be ``output_slices``."""
    widths = tuple(b.size(-2) for b in lora_b_stacked)
    if widths != tuple(output_slices):
        raise ValueError(f"output_slices {tuple(output_slices)} differ from the LoRA-B widths {widths}")
