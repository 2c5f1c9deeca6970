"""``KernelTarget``: the wrapper methods derived from a vendor's kernel ops, composed as vLLM does.

A vendor who implements only kernels subclasses :class:`KernelTarget`, defines its kernel ops as
methods (or staticmethods) with the suite's signatures, and ``default_device`` when its tensors do
not live on the CPU. The base supplies ``update_metadata`` and every wrapper method, each composed
from the kernels the subclass defines by one of four compositions (``conformance.ops.COMPOSITIONS``):
vLLM's two wrappers, and one for a backend that has only one family of the classic kernels.

* **lora** (vLLM's ``PunicaWrapperGPU``): ``lora_shrink`` / ``lora_expand`` fed by
  ``LoRAKernelMeta`` built for the tokens (linear, embedding) and for the sampled rows (logits);
  the fused-MoE ops as that wrapper's ``add_lora_w13`` / ``add_lora_w2``: ``moe_lora_align_block_size``
  sorts each slot's (token, choice) pairs by local expert into blocks of ``moe_block_size``, then
  ``fused_moe_lora`` walks those blocks (w2 with ``mul_routed_weight``);
* **classic** (vLLM's ``PunicaWrapperCPU``): a prefill batch goes to the sgmv ops with
  ``SegmentMetadata`` (runs of equal slots; nothing is launched when every token has slot −1), a
  decode batch to the bgmv ops with one slot per token; the logits and the full linear always go to
  the bgmv ops with one slot per sampled row. So it needs both families;
* **bgmv** (the bgmv ops alone): every batch, prefill or decode, through the bgmv ops with one slot
  per token, and the logits and the full linear with one slot per sampled row. bgmv takes any
  pattern of slots, and vLLM's CPU wrapper itself sends its decode batches and sampled rows there;
* **sgmv** (the sgmv ops alone): every batch through the sgmv ops with ``SegmentMetadata`` of the
  tokens (a decode batch is runs of one or more tokens, still a valid segment list), and the logits
  and the full linear with ``SegmentMetadata`` of the sampled rows; nothing is launched for rows
  that are all slot −1.

In the classic, bgmv and sgmv compositions slices are expanded one by one with the ``*_expand_slice``
op at a running column offset that starts at ``offset_start``. No dense kernel can stand in for
``fused_moe_lora``: the MoE ops need it in every composition. vLLM's CPU wrapper has no MoE LoRA; like
bgmv's one index per row, every composition but lora gives ``fused_moe_lora`` one expert per pair and
no sorting (the naive block assignment, which vLLM's GPU wrapper itself uses for sparse batches):
``sorted_token_ids`` and ``num_tokens_post_padded`` None, ``expert_ids`` the pairs' local experts
(``expert_map[topk_ids]``, −1 for an expert on another rank, which the kernel skips).

Every MoE composition hands ``fused_moe_lora`` shared stacks (expert dim 1: w13's LoRA-A, w2's
LoRA-B) expanded to every local expert with stride 0, as vLLM's layer does; the local experts are the
expert dim of the stacks that are not shared. Like vLLM's wrapper, none launches anything when
every token has slot −1.

Which kernels each wrapper op needs is data on its spec (``OpSpec.compositions``, or
``OpSpec.composed_of`` for ``add_lora_linear``: ``add_shrink`` then ``add_expand``, each by whichever
composition it has); the table at the end of this docstring is generated from the specs. Each
kernel-backed wrapper op uses the first composition in ``wrapper_paths`` whose kernels the target
all defines: ``("lora", "classic", "bgmv", "sgmv")`` unless a subclass orders them otherwise or
leaves some out; ``wrapper_path(op)`` says which one an op gets, and ``python -m conformance.targets
describe`` prints it. The choice is per op, so a backend with ``lora_shrink`` and the bgmv ops shrinks
through ``lora_shrink`` and expands through ``bgmv_expand_slice``. A wrapper op whose kernels are
missing in every composition tried is not implemented, so the runner reports its cases "not
supported". A wrapper method the subclass defines itself always wins and counts as implemented (set
it to ``None`` to opt out of one); ``add_lora_linear`` calls ``self.add_shrink`` and
``self.add_expand``, so it composes from overridden ones too.

Where vLLM's wrappers disagree with each other, the suite's semantics (``conformance.reference``)
decide, and so does this base:

* ``add_inputs`` of ``add_expand`` is honoured (vLLM's GPU wrapper always accumulates);
* LoRA bias (``lora_bias_stacked``) is added after the LoRA-B product, unscaled, to the rows whose
  slot is not −1, in the columns of its slice counted from ``offset_start`` (vLLM's ``_apply_bias``
  starts at column 0 and runs before the expand, which then overwrites it when ``add_inputs=False``);
* ``add_lora_linear`` and ``add_lora_logits`` shrink into a zeroed float32 buffer of the LoRA-B rank
  when the caller passes ``buffer=None`` (a caller's buffer must be zeroed, as in vLLM);
* ``apply_lora_full_linear`` is composed as both vLLM wrappers compose it: the whole per-slot weight
  shrunk at scale 1 over the sampled rows into a zeroed float32 buffer (``lora_shrink`` with the
  sampled rows' metadata, ``bgmv_shrink`` with their slots, or ``sgmv_shrink`` with their segments),
  then the bias added in float32 and the rows of an enabled slot replaced (rounded once), every other
  row kept by ``torch.where``;
* ``token_classification_head`` (vLLM 0.33's token head, no PunicaWrapper method) is that layer's code
  over ``self.add_shrink`` and the tokens' slots (``conformance.targets.classification_head``), so it
  composes from an overridden ``add_shrink`` too;
* vLLM 0.34's layer ops (``grouped_lora_linear``, ``fp32_output_lora_linear``, ``scaled_embedding_lora``) are those
  layers' code over ``self.add_lora_linear`` / ``self.add_lora_embedding`` (``conformance.targets.vllm034_layers``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from conformance.ops import COMPOSITIONS, OP_SPECS, Level, ops_at
from conformance.ops.tables import composition_table
from conformance.reference import LoRAKernelMeta, LoRAMapping, SegmentMetadata, aligned_buffers

from .base import Target
from .classification_head import TokenHeadFromShrink, pick_head_rows
from .vllm034_layers import Vllm034Layers

# The table of the kernels each wrapper op needs, rendered from the specs rather than kept by hand here
# (no docstring to extend under ``python -OO``).
if __doc__ is not None:
    __doc__ += "\nThe kernels each wrapper op needs, per composition (from ``conformance.ops.OP_SPECS``):\n\n" + composition_table()


class KernelTarget(TokenHeadFromShrink, Vllm034Layers, Target):
    """Base of targets that implement kernel ops only; see the module docstring.

    ``wrapper_paths`` is part of the contract: the compositions (``conformance.ops.COMPOSITIONS``) tried,
    in order, for each kernel-backed wrapper op; the op uses the first whose kernels the target all
    defines (``wrapper_path(op)``), and is not implemented when there is none. A subclass reorders the
    tuple to prefer one, or leaves a composition out to never use it; a name that is no composition is
    refused when the subclass is made.

    After ``update_metadata`` these attributes describe the batch, on ``self.device``:
    ``token_indices`` / ``sampled_indices`` (slot per token / per sampled row, int64),
    ``token_meta`` / ``sampled_meta`` (:class:`LoRAKernelMeta`), ``segments`` / ``sampled_segments``
    (:class:`SegmentMetadata` of the tokens / of the sampled rows) and ``is_prefill``.
    """

    name = "kernel-ops"
    description = "wrapper methods derived from the kernel ops a subclass defines"
    # vLLM's GPU wrapper, then its CPU wrapper, then the bgmv ops alone, then the sgmv ops alone: a
    # backend with both kernel families gets vLLM's own split of them rather than one family for all.
    wrapper_paths: ClassVar[tuple[str, ...]] = ("lora", "classic", "bgmv", "sgmv")
    # The block size the lora composition aligns the MoE pairs to, passed as ``shrink_block_size_m``
    # (vLLM takes it from its Triton tile config; the result does not depend on it).
    moe_block_size: ClassVar[int] = 16

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name, declared in vars(cls).items():
            if type(declared).__name__ == "KernelAdapter":  # conformance.targets.kernel_adapter, which imports this module
                declared.bind(name)  # checked against the op's spec now, when the class is made
        unknown = [path for path in cls.wrapper_paths if path not in COMPOSITIONS]
        if unknown:
            raise ValueError(f"{cls.__name__}.wrapper_paths names {unknown}, which are no compositions; they are {', '.join(COMPOSITIONS)}")

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
        compositions = OP_SPECS[op].compositions
        for path in self.wrapper_paths:
            if path in compositions and set(compositions[path]) <= present:
                return path
        return None

    def wrapper_implemented(self, op: str) -> bool:
        if not callable(getattr(self, op, None)):  # a subclass opted out with ``op = None``
            return False
        if self.overrides(op):
            return True
        if OP_SPECS[op].composed_of:
            return all(self.wrapper_implemented(part) for part in OP_SPECS[op].composed_of)
        return self.wrapper_path(op) is not None

    def implemented_ops(self) -> tuple[str, ...]:
        return self.kernel_ops() + tuple(op for op in ops_at(Level.WRAPPER) if self.wrapper_implemented(op))

    def derived_from(self, op: str) -> tuple[str, ...]:
        """The kernel ops the derived wrapper method ``op`` calls (through its parts for ``add_lora_linear``);
        ``()`` when the subclass defines ``op`` itself or it is not implemented."""
        if not self.wrapper_implemented(op) or self.overrides(op):
            return ()
        spec = OP_SPECS[op]
        if spec.composed_of:
            return tuple(dict.fromkeys(kernel for part in spec.composed_of for kernel in self.derived_from(part)))
        return spec.compositions[self.wrapper_path(op)]

    def _path(self, op: str) -> str:
        """``wrapper_path(op)``, or NotImplementedError naming the kernels that would make it work."""
        path = self.wrapper_path(op)
        if path is None:
            compositions = OP_SPECS[op].compositions
            options = " or ".join(" and ".join(compositions[p]) for p in self.wrapper_paths if p in compositions)
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
        self.sampled_segments = self.segment_meta(sampled)

    def kernel_meta(self, slots: torch.Tensor, num_slots: int) -> LoRAKernelMeta:
        """``lora_*`` metadata for one slot per row, on the device (the flag stays on the CPU)."""
        return LoRAKernelMeta.build(slots, num_slots).to(self.device)

    def segment_meta(self, slots: torch.Tensor) -> SegmentMetadata:
        """sgmv metadata (runs of equal slots) for one slot per row, on the device."""
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
        path = self._path("add_shrink")
        if path == "lora":
            self.lora_shrink(x, list(lora_a_stacked), y, *self._meta_args(self.token_meta, x.size(0)), scale)
            return
        for s, lora_a in enumerate(lora_a_stacked):
            self._shrink(path, "tokens", y[s], x, lora_a, scale)

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
        path = self._path("add_expand")
        if path == "lora":
            x = torch.stack(tuple(x)) if isinstance(x, (tuple, list)) else x
            meta = self._meta_args(self.token_meta, y2d.size(0))
            self.lora_expand(x, list(lora_b_stacked), y2d, *meta, offset_start, add_inputs)
        else:
            column = offset_start
            for s, (lora_b, width) in enumerate(zip(lora_b_stacked, output_slices, strict=True)):
                self._expand_slice(path, y2d, x[s], lora_b, column, width, add_inputs)
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
        add_inputs: bool = True,
        **kwargs,
    ) -> None:
        """``add_shrink`` into a float32 buffer, then ``add_expand(add_inputs)`` with the bias."""
        if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices):
            raise ValueError("lora_a_stacked, lora_b_stacked and output_slices must have one entry per slice")
        x = x.reshape(-1, x.size(-1))
        if buffer is None:
            buffer = self.zero_buffer(len(output_slices), x.size(0), lora_b_stacked[0].size(-1))
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, 0, add_inputs, lora_bias_stacked=lora_bias_stacked)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool = True, **kwargs) -> None:
        """``y[t] (+)= x[t] @ B[slot_t]ᵀ``; ``x`` holds the LoRA-A rows the embedding layer looked up."""
        y2d = y.view(-1, y.size(-1))
        path = self._path("add_lora_embedding")
        if path == "lora":
            meta = self._meta_args(self.token_meta, y2d.size(0))
            self.lora_expand(x.unsqueeze(0), [lora_b_stacked], y2d, *meta, 0, add_inputs)
        else:
            self._expand(path, "tokens", y2d, x, lora_b_stacked, add_inputs)

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
        path = self._path("add_lora_logits")
        if path == "lora":
            meta = self._meta_args(self.sampled_meta, x.size(0))
            self.lora_shrink(x, [lora_a_stacked], buffer.unsqueeze(0), *meta, scale)
            self.lora_expand(buffer.unsqueeze(0), [lora_b_stacked], y2d, *meta, 0, True)
        else:
            self._shrink(path, "sampled", buffer, x, lora_a_stacked, scale)
            self._expand(path, "sampled", y2d, buffer, lora_b_stacked, True)

    def apply_lora_full_linear(self, y: torch.Tensor, x: torch.Tensor, weight_stacked: torch.Tensor,
                               bias_stacked: torch.Tensor | None, module_enabled: torch.Tensor) -> None:
        """``y[p] = x[p] @ W[slot_p]ᵀ + bias[slot_p]`` for sampled rows of an enabled slot; the row is replaced."""
        y2d = y.view(-1, y.size(-1))
        x = x.reshape(-1, x.size(-1))
        product = self.zero_buffer(1, x.size(0), weight_stacked.size(-2))[0]
        path = self._path("apply_lora_full_linear")
        if path == "lora":
            meta = self._meta_args(self.sampled_meta, x.size(0))
            self.lora_shrink(x, [weight_stacked], product.unsqueeze(0), *meta, 1.0)
        else:
            self._shrink(path, "sampled", product, x, weight_stacked, 1.0)
        pick_head_rows(y2d, product, bias_stacked, module_enabled, self.sampled_indices)

    def token_lora_slots(self) -> torch.Tensor:
        """The tokens' slots for ``token_classification_head`` (which composes from ``self.add_shrink``)."""
        return self.token_indices

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                     expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        """``y[t, k, offset + s·N …] (+)= (x[t] @ A_s[l, e]ᵀ) @ B_s[l, e]ᵀ``: ``fused_moe_lora`` without the routing weight."""
        self._fused_moe("add_lora_w13", y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled,
                        expert_map, offset, add_inputs, mul_routed_weight=False)

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                    expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        """``y[t, k, offset …] (+)= w[t, k] · (x[t·top_k + k] @ A[l, e]ᵀ) @ B[l, e]ᵀ``: ``mul_routed_weight``."""
        self._fused_moe("add_lora_w2", y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled,
                        expert_map, offset, add_inputs, mul_routed_weight=True)

    # -- the fused-MoE compositions (vLLM's PunicaWrapperGPU.add_lora_w13 / add_lora_w2) ----------

    def _fused_moe(self, op, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, expert_map,
                   offset: int, add_inputs: bool, *, mul_routed_weight: bool) -> None:
        path = self._path(op)
        num_tokens, top_k = topk_ids.shape
        token_slots, _, _, _, lora_ids, no_lora = self._meta_args(self.token_meta, num_tokens)
        if bool(no_lora.item()):  # every token has slot −1: vLLM's wrapper launches nothing
            return
        experts = max(stack.size(1) for stack in (*lora_a_stacked, *lora_b_stacked))
        if path == "lora":
            sorted_ids, expert_ids, padded = self.moe_aligned_metadata(topk_ids, token_slots, lora_ids, adapter_enabled,
                                                                       expert_map, lora_a_stacked[0].size(0), experts)
        else:
            sorted_ids, expert_ids, padded = None, pair_local_experts(topk_ids, expert_map), None
        tiles = (self.moe_block_size, 64, 32, 8, 4, 3, 1) * 2  # Triton's shrink and expand tiles (BLOCK_M, N, K, GROUP_M, warps, stages, split_k)
        self.fused_moe_lora(
            y, x, expanded_to(lora_a_stacked, experts), expanded_to(lora_b_stacked, experts), topk_weights, sorted_ids,
            expert_ids, padded, token_slots, lora_a_stacked[0].size(2), top_k, lora_ids,
            torch.tensor([lora_ids.numel()]), adapter_enabled, *tiles, mul_routed_weight, offset > 0, offset, add_inputs,
        )  # fmt: skip

    def moe_aligned_metadata(self, topk_ids, token_slots, lora_ids, adapter_enabled, expert_map, max_loras: int,
                             local_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sorted_token_ids [L, P], expert_ids [L, B], num_tokens_post_pad [L])`` from ``moe_lora_align_block_size``,
        its buffers sized as vLLM's wrapper sizes them (for the global experts under expert parallelism)."""
        num_experts = expert_map.numel() if expert_map is not None else local_experts
        sorted_ids, expert_ids, padded, blocks, per_slot = aligned_buffers(
            topk_ids.numel(), num_experts, self.moe_block_size, max_loras, self.device
        )
        self.moe_lora_align_block_size(topk_ids, token_slots, num_experts, self.moe_block_size, max_loras, per_slot, blocks,
                                       sorted_ids, expert_ids, padded, adapter_enabled, lora_ids, expert_map)
        return sorted_ids.view(max_loras, -1), expert_ids.view(max_loras, -1), padded

    # -- the classic, bgmv and sgmv compositions: one kernel family per launch -------------------

    def kernel_family(self, path: str, rows: str) -> str:
        """The kernels (``"bgmv"`` or ``"sgmv"``) composition ``path`` runs ``rows`` (``"tokens"`` or
        ``"sampled"``) through: vLLM's CPU wrapper (classic) splits a prefill batch's tokens (sgmv) from
        the rest (bgmv); the bgmv and sgmv compositions send everything to their own family."""
        if path == "classic":
            return "sgmv" if rows == "tokens" and self.is_prefill else "bgmv"
        if path in ("bgmv", "sgmv"):
            return path
        raise ValueError(f"composition {path!r} does not run through the bgmv or sgmv ops")

    def _row_slots(self, rows: str) -> torch.Tensor:
        """bgmv's metadata: one slot per row."""
        return self.token_indices if rows == "tokens" else self.sampled_indices

    def _row_segments(self, rows: str) -> SegmentMetadata:
        """sgmv's metadata: runs of equal slots."""
        return self.segments if rows == "tokens" else self.sampled_segments

    # Like vLLM's CPU wrapper, the sgmv ops are not launched when every row has slot −1 (its bgmv ops are).

    def _shrink(self, path: str, rows: str, y, x, lora_a, scale: float) -> None:
        if self.kernel_family(path, rows) == "bgmv":
            self.bgmv_shrink(x, lora_a, y, self._row_slots(rows), scale)
        elif not (segments := self._row_segments(rows)).no_lora:
            self.sgmv_shrink(x, lora_a, y, *segments.args(), scale)

    def _expand_slice(self, path: str, y, x, lora_b, offset: int, width: int, add_inputs: bool) -> None:
        if self.kernel_family(path, "tokens") == "bgmv":
            self.bgmv_expand_slice(x, lora_b, y, self.token_indices, offset, width, add_inputs)
        elif not self.segments.no_lora:
            self.sgmv_expand_slice(x, lora_b, y, *self.segments.args(), offset, width, add_inputs)

    def _expand(self, path: str, rows: str, y, x, lora_b, add_inputs: bool) -> None:
        if self.kernel_family(path, rows) == "bgmv":
            self.bgmv_expand(x, lora_b, y, self._row_slots(rows), add_inputs)
        elif not (segments := self._row_segments(rows)).no_lora:
            self.sgmv_expand(x, lora_b, y, *segments.args(), add_inputs)

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


def expanded_to(stacks, experts: int) -> list[torch.Tensor]:
    """MoE stacks ``[L, E, rows, cols]`` with a shared one (expert dim 1) expanded to ``experts`` with stride 0."""
    return [stack.expand(-1, experts, -1, -1) if stack.size(1) == 1 else stack for stack in stacks]


def pair_local_experts(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """int32 ``[T·top_k]``: the local expert of every pair, ``expert_map[topk_ids]`` (−1: on another rank)."""
    experts = topk_ids.reshape(-1).long()
    if expert_map is not None:
        experts = expert_map.long()[experts]
    return experts.to(torch.int32)


def _check_slices(lora_b_stacked, output_slices) -> None:
    """The LoRA-B stacks' widths (dim −2) must be ``output_slices``."""
    widths = tuple(b.size(-2) for b in lora_b_stacked)
    if widths != tuple(output_slices):
        raise ValueError(f"output_slices {tuple(output_slices)} differ from the LoRA-B widths {widths}")
