"""The reference PunicaWrapper: vLLM's wrapper methods composed from ``lora_shrink`` / ``lora_expand``.

Method names, argument names and argument order are vLLM's (``PunicaWrapperBase``), with LoRA bias as
the optional keyword ``lora_bias_stacked``. ``update_metadata`` takes the suite's slot-based
``LoRAMapping``. Semantics, for a row ``t`` of slot ``l ≠ −1`` (rows of slot −1 are never written):

* ``add_shrink``:  ``y[s, t] += scale · x[t] @ A_s[l]ᵀ``
* ``add_expand``:  ``y[t, cols_s] = (y[t, cols_s] if add_inputs else 0) + x[s, t] @ B_s[l]ᵀ + bias_s[l]``
  with ``cols_s`` starting at ``offset_start + Σ_{j<s} N_j``; the bias is not scaled and follows
  ``offset_start`` like the LoRA delta does;
* ``add_lora_linear``: ``add_shrink`` into a zeroed float32 buffer, then ``add_expand`` with the keyword
  ``add_inputs`` (default True; False writes the LoRA output alone, vLLM's GPU dual-stream path);
* ``add_lora_embedding``: ``y[t] (+)= x[t] @ B[l]ᵀ`` (``x`` holds the LoRA-A rows already looked up);
* ``add_lora_logits``: ``add_lora_linear`` for one slice, indexed by the sampled rows' slots;
* ``add_lora_w13`` / ``add_lora_w2``: the fused-MoE LoRA deltas (docs/moe.md), composed as vLLM's GPU
  wrapper composes them: ``moe_lora_align_block_size`` into block-aligned metadata, then
  ``fused_moe_lora`` (w2 with ``mul_routed_weight``). The suite's hardware-neutral signature: no
  Triton tile configs, and w2 takes the routing rather than w13's sorted ids;
* ``apply_lora_full_linear(y, x, weight_stacked, bias_stacked, module_enabled)``: a whole replacement
  linear layer per adapter (vLLM's classification heads, ``modules_to_save``), indexed by the *sampled*
  rows' slots (one per request, as vLLM's wrappers index it): for a row of slot ``l ≠ −1`` with
  ``module_enabled[l]``, ``y[p] = x[p] @ W[l]ᵀ + bias[l]``, computed in float32 (float64 for the
  oracle) and rounded once to ``y``'s dtype; the row is *replaced*, not accumulated into. ``W`` is
  ``[L, (1,) P, H]``, ``bias`` ``[L, P]`` (``None``: no bias), ``module_enabled`` bool ``[L]``. Rows of
  slot −1 and rows whose slot's module is disabled stay bit-identical;
* ``token_classification_head(y, x, weight_stacked, bias_stacked, module_enabled)``: the same head over the
  *token* rows' slots (vLLM 0.33's ``TokenClassificationHeadWithLoRA``, which has no wrapper method of its
  own: it calls ``add_shrink`` and picks the rows itself; ``classification_head.py`` says how);
* vLLM 0.34's layers whose code is more than one wrapper call, each in a module of its own:
  ``grouped_lora_linear`` (head groups sharing LoRA-A, ``grouped_lora.py``), ``fp32_output_lora_linear`` (the
  delta in the LoRA dtype added to a float32 output, ``fp32_output.py``) and ``scaled_embedding_lora``
  (``embed_scale`` folded into LoRA-B, then ``add_lora_embedding``; ``embed_scale.py``).
"""

from __future__ import annotations

import torch

from ._grouping import rows_per_adapter
from ._stacks import accumulation_dtype, weight_stack
from .classification_head import replace_rows_with_head
from .embed_scale import fold_embed_scale
from .fp32_output import add_lora_to_fp32_output
from .grouped_lora import add_grouped_lora
from .kernel_meta import LoRAKernelMeta
from .mapping import LoRAMapping
from .op_fused_moe_lora import fused_moe_lora
from .op_lora_expand import lora_expand
from .op_lora_shrink import lora_shrink
from .op_moe_lora_align_block_size import moe_lora_align_block_size

# The block size the reference wrapper aligns the MoE pairs to (any size gives the same result).
MOE_BLOCK_SIZE = 16


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
        add_inputs: bool = True,
        **kwargs,
    ) -> None:
        # add_inputs=False: the written columns of adapter rows get the LoRA output alone (vLLM's GPU
        # wrapper takes it from **kwargs for its dual-stream path and hands it to add_expand).
        x = x.reshape(-1, x.size(-1))
        if buffer is None:
            buffer = self._shrink_buffer(len(lora_a_stacked), x, lora_a_stacked[0])
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, 0, add_inputs, lora_bias_stacked=lora_bias_stacked)

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

    def apply_lora_full_linear(self, y: torch.Tensor, x: torch.Tensor, weight_stacked: torch.Tensor,
                               bias_stacked: torch.Tensor | None, module_enabled: torch.Tensor) -> None:
        """``y[p] = x[p] @ W[l]ᵀ + bias[l]`` for sampled rows of an enabled slot ``l``; every other row untouched."""
        x = x.reshape(-1, x.size(-1))
        self._meta(self.sampled_meta, x.size(0))
        replace_rows_with_head(y.view(-1, y.size(-1)), x, weight_stacked, bias_stacked, module_enabled,
                               self.mapping.sampled_slot_tensor())

    def token_classification_head(self, y: torch.Tensor, x: torch.Tensor, weight_stacked: torch.Tensor,
                                  bias_stacked: torch.Tensor, module_enabled: torch.Tensor) -> None:
        """``y[t] = x[t] @ W[l]ᵀ + bias[l]`` for *tokens* of an enabled slot ``l`` (vLLM 0.33's token head); others untouched."""
        x = x.reshape(-1, x.size(-1))
        self._meta(self.token_meta, x.size(0))
        replace_rows_with_head(y.view(-1, y.size(-1)), x, weight_stacked, bias_stacked, module_enabled,
                               self.mapping.token_slot_tensor())

    def grouped_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                            lora_b_stacked: tuple[torch.Tensor, ...], scale: float) -> None:
        """``y[t, g] += scale · (x[t, g] @ A[l]ᵀ) @ B_g[l]ᵀ``: every head group's own LoRA-B, one shared LoRA-A."""
        add_grouped_lora(self.add_lora_linear, y, x, lora_a_stacked, lora_b_stacked, scale)

    def fp32_output_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                                lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...]) -> None:
        """``y += round_lora_dtype(add_lora_linear's delta)``, ``y`` float32."""
        add_lora_to_fp32_output(self.add_lora_linear, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices)

    def scaled_embedding_lora(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, embed_scale: float | None,
                              add_inputs: bool = True) -> None:
        """``y[t] (+)= x[t] @ (embed_scale · B[l])ᵀ``: the scale folded into LoRA-B once, then ``add_lora_embedding``."""
        self.add_lora_embedding(y, x, fold_embed_scale(lora_b_stacked, embed_scale), add_inputs)

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                     expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        """``y[t, k, offset + s·N …] (+)= (x[t] @ A_s[l, e]ᵀ) @ B_s[l, e]ᵀ``: no routing weight."""
        self._fused_moe(y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, expert_map, offset,
                        add_inputs, mul_routed_weight=False)

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                    expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        """``y[t, k, offset …] (+)= w[t, k] · (x[t·top_k + k] @ A[l, e]ᵀ) @ B[l, e]ᵀ``: the routing weight applied."""
        self._fused_moe(y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, expert_map, offset,
                        add_inputs, mul_routed_weight=True)

    def _fused_moe(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, expert_map,
                   offset, add_inputs, *, mul_routed_weight: bool) -> None:
        num_tokens, top_k = topk_ids.shape
        meta = self._meta(self.token_meta, num_tokens)
        token_slots, lora_ids = meta[0], meta[4]
        max_loras = lora_a_stacked[0].size(0)
        # the local experts: the expert dim of a stack that is not shared (a shared one has 1)
        local_experts = max(lora_a_stacked[0].size(1), lora_b_stacked[0].size(1))
        num_experts = expert_map.numel() if expert_map is not None else local_experts
        sorted_ids, expert_ids, padded, blocks, per_slot = aligned_buffers(topk_ids.numel(), num_experts, MOE_BLOCK_SIZE, max_loras, y.device)
        moe_lora_align_block_size(topk_ids, token_slots, num_experts, MOE_BLOCK_SIZE, max_loras, per_slot, blocks, sorted_ids,
                                  expert_ids, padded, adapter_enabled, lora_ids, expert_map)
        rank = lora_a_stacked[0].size(2)
        tiles = (MOE_BLOCK_SIZE, 64, 32, 8, 4, 3, 1) * 2  # Triton's shrink and expand tiles: unused here
        fused_moe_lora(y, x, list(lora_a_stacked), list(lora_b_stacked), topk_weights, sorted_ids.view(max_loras, -1),
                       expert_ids.view(max_loras, -1), padded, token_slots, rank, top_k, lora_ids,
                       torch.tensor([lora_ids.numel()]), adapter_enabled, *tiles, mul_routed_weight, offset > 0, offset,
                       add_inputs)

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


def aligned_sizes(num_pairs: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """``(max_num_tokens_padded, max_num_m_blocks)`` per slot, as vLLM's wrapper sizes them."""
    per_slot = num_pairs + num_experts * (block_size - 1)
    if num_pairs < num_experts:
        per_slot = num_pairs * block_size
    return per_slot, -(-per_slot // block_size)


def aligned_buffers(num_pairs: int, num_experts: int, block_size: int, max_loras: int, device) -> tuple:
    """The outputs of ``moe_lora_align_block_size`` sized by :func:`aligned_sizes`.

    ``(sorted_token_ids, expert_ids, num_tokens_post_pad, max_num_m_blocks, max_num_tokens_padded)``;
    sorted ids start at −1 and the counts at −1 (so an entry the op must write and does not shows), the
    expert ids at −1 (as vLLM initializes them: an untouched block is skipped).
    """
    per_slot, blocks = aligned_sizes(num_pairs, num_experts, block_size)
    return (
        torch.full((max_loras * per_slot,), -1, dtype=torch.int32, device=device),
        torch.full((max_loras * blocks,), -1, dtype=torch.int32, device=device),
        torch.full((max_loras,), -1, dtype=torch.int32, device=device),
        blocks,
        per_slot,
    )
