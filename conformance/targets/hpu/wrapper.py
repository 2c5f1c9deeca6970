"""vLLM's PunicaWrapper methods on the HPU engine (names, argument names and order as vLLM's).

Semantics are the suite's (``conformance/reference/punica_wrapper.py``); for a row of slot ``l ≠ −1``:

* ``add_shrink``:  ``y[s, t] += scale · x[t] @ A_s[l]ᵀ`` (``y`` the caller's float32 ``[S, T, R]`` buffer,
  or a tuple of ``[T, R]`` buffers as vLLM's CPU wrapper passes them);
* ``add_expand``:  ``y[t, cols_s] = (y if add_inputs else 0) + x[s, t] @ B_s[l]ᵀ + bias_s[l]``, slice ``s``
  starting at ``offset_start + Σ_{j<s} N_j``; the bias is unscaled and follows ``offset_start``;
* ``add_lora_linear``: ``y[t, cols_s] += scale · (x[t] @ A_s[l]ᵀ) @ B_s[l]ᵀ (+ bias_s[l])``, computed
  fused (the ``[T, L·R]`` intermediate goes straight into the expand), rounded exactly as the shrink
  into a float32 buffer followed by the expand would round; ``buffer`` is accepted and not needed;
* ``add_lora_embedding``: ``y[t] (+)= x[t] @ B[l]ᵀ`` (``x`` holds the LoRA-A rows already looked up);
* ``add_lora_logits``: the fused linear over the *sampled* rows, with their own row state (Gaudi's
  separate logits mask);
* ``apply_lora_full_linear``: ``y[p] = x[p] @ W[l]ᵀ + bias[l]`` over the sampled rows whose slot's
  module is enabled, the row *replaced* (rounded once from float32); disabled slots become −1 rows
  of the same bucket, so the shapes and the compiled graph do not depend on ``module_enabled``;
* ``token_classification_head`` (vLLM 0.33's token head, no PunicaWrapper method): ``add_shrink`` above
  with the whole head as a one-slice stack, then the layer's pick (``conformance.targets.classification_head``);
* vLLM 0.34's layer ops (``grouped_lora_linear``, ``fp32_output_lora_linear``, ``scaled_embedding_lora``): those
  layers' code over the methods above (``conformance.targets.vllm034_layers``), static shapes, no host sync.

Rows of slot −1 are never written, also with ``add_inputs=False``. The row state comes from
``update_metadata`` (the suite's ``LoRAMapping``) or ``set_slots`` (raw slot vectors, as the vLLM
subclass passes them). After every method the device layer's ``after_op`` runs (``mark_step`` in lazy
mode), so outputs can be read.
"""

from __future__ import annotations

import torch

from conformance.reference import LoRAMapping

from ..classification_head import TokenHeadFromShrink
from ..vllm034_layers import Vllm034Layers
from .engine import LoRAEngine
from .rows import PaddedRows, RoutedPairs
from .stacks import as_3d


class HpuPunicaWrapper(TokenHeadFromShrink, Vllm034Layers):
    def __init__(self, engine: LoRAEngine) -> None:
        self.engine = engine
        self.token_rows: PaddedRows | None = None
        self.sampled_rows: PaddedRows | None = None
        self.serving: dict[str, torch.Tensor] = {}  # persistent slot vectors, once start_serving ran

    def start_serving(self, capacity) -> None:
        """Slot vectors that live as long as the server: ``update_metadata`` then writes each batch's slots into
        them in place, so a captured graph, which reads the tensors it saw at capture, reads the new batch. Each
        is as long as the bucket of the largest batch (``capacity.max_tokens``), its tail −1."""
        rows = self.engine.buckets.bucket(max(capacity.max_tokens, 1))
        device = self.engine.device
        self.serving = {kind: torch.full((rows,), -1, dtype=torch.int32, device=device) for kind in ("token", "sampled")}

    # -- the batch -----------------------------------------------------------------------------

    def update_metadata(self, mapping: LoRAMapping) -> None:
        self.set_slots(mapping.token_slot_tensor(), mapping.sampled_slot_tensor())

    def set_slots(self, token_slots: torch.Tensor, sampled_slots: torch.Tensor) -> None:
        """One slot per token and one per sampled row (−1 = none); padded and masked on the device."""
        if self.serving:
            self.token_rows = self._in_place("token", token_slots)
            self.sampled_rows = self._in_place("sampled", sampled_slots)
            return
        self.token_rows = self.engine.rows(token_slots)
        self.sampled_rows = self.engine.rows(sampled_slots)

    def _in_place(self, kind: str, slots: torch.Tensor) -> PaddedRows:
        """The batch's slots written into the persistent vector, the whole tail reset to −1 (no stale rows)."""
        buffer, count = self.serving[kind], slots.numel()
        if count > buffer.numel():
            raise ValueError(f"a batch of {count} rows is larger than the {buffer.numel()} start_serving made room for")
        buffer[:count].copy_(slots.reshape(-1))
        buffer[count:].fill_(-1)
        return PaddedRows(buffer[: self.engine.buckets.bucket(max(count, 1))], count)

    def token_lora_slots(self) -> torch.Tensor:
        """The real tokens' slots (the bucket's padding cut off), for ``token_classification_head``."""
        rows = self._rows(self.token_rows)
        return rows.slots[: rows.count]

    def _rows(self, rows: PaddedRows | None) -> PaddedRows:
        if rows is None:
            raise RuntimeError("update_metadata(mapping) must be called before the wrapper methods")
        return rows

    # -- the methods ---------------------------------------------------------------------------

    def add_shrink(self, y, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float, **kwargs) -> None:
        x = x.reshape(-1, x.size(-1))
        outputs = tuple(y) if isinstance(y, (tuple, list)) else tuple(y[s] for s in range(y.size(0)))
        if len(outputs) != len(lora_a_stacked):
            raise ValueError(f"{len(outputs)} output slices but {len(lora_a_stacked)} LoRA-A stacks")
        rows = self._rows(self.token_rows)
        for out, lora_a in zip(outputs, lora_a_stacked, strict=True):
            self.engine.shrink_into(out, x, lora_a, rows, scale)
        self.engine.layer.after_op()

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
        inputs = tuple(x) if isinstance(x, (tuple, list)) else tuple(x[s] for s in range(x.size(0)))
        _check_slices(lora_b_stacked, output_slices, inputs)
        biases = lora_bias_stacked if lora_bias_stacked is not None else (None,) * len(lora_b_stacked)
        rows = self._rows(self.token_rows)
        column = offset_start
        for s, lora_b, bias, width in zip(inputs, lora_b_stacked, biases, output_slices, strict=True):
            self.engine.expand_into(y2d, s, lora_b, rows, column, add_inputs, bias)
            column += width
        self.engine.layer.after_op()

    def add_lora_embedding(
        self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool = True, **kwargs
    ) -> None:
        y2d = y.view(-1, y.size(-1))
        self.engine.expand_into(y2d, x.reshape(-1, x.size(-1)), lora_b_stacked, self._rows(self.token_rows), 0, add_inputs)
        self.engine.layer.after_op()

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer=None,
        lora_bias_stacked: tuple[torch.Tensor | None, ...] | None = None,
        add_inputs: bool = True,
        **kwargs,
    ) -> None:
        # `buffer` (vLLM's zeroed shrink buffer) is not needed: the fused math keeps the intermediate itself.
        y2d = y.view(-1, y.size(-1))
        x = x.reshape(-1, x.size(-1))
        if len(lora_a_stacked) != len(lora_b_stacked):
            raise ValueError(f"{len(lora_a_stacked)} LoRA-A stacks but {len(lora_b_stacked)} LoRA-B stacks")
        _check_slices(lora_b_stacked, output_slices)
        biases = lora_bias_stacked if lora_bias_stacked is not None else (None,) * len(lora_b_stacked)
        rows = self._rows(self.token_rows)
        column = 0
        for lora_a, lora_b, bias, width in zip(lora_a_stacked, lora_b_stacked, biases, output_slices, strict=True):
            self.engine.linear_into(y2d, x, lora_a, lora_b, rows, column, scale, bias, add_inputs)
            column += width
        self.engine.layer.after_op()

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer=None,
        **kwargs,
    ) -> None:
        y2d = y.view(-1, y.size(-1))
        x = x.reshape(-1, x.size(-1))
        self.engine.linear_into(y2d, x, lora_a_stacked, lora_b_stacked, self._rows(self.sampled_rows), 0, scale)
        self.engine.layer.after_op()

    def apply_lora_full_linear(
        self, y: torch.Tensor, x: torch.Tensor, weight_stacked: torch.Tensor, bias_stacked: torch.Tensor | None,
        module_enabled: torch.Tensor,
    ) -> None:
        if module_enabled.numel() != as_3d(weight_stacked).size(0):
            raise ValueError(f"module_enabled has {module_enabled.numel()} entries, the weights {as_3d(weight_stacked).size(0)} slots")
        rows = self._rows(self.sampled_rows).only_enabled(module_enabled)
        self.engine.full_linear_into(y.view(-1, y.size(-1)), x.reshape(-1, x.size(-1)), weight_stacked, bias_stacked, rows)
        self.engine.layer.after_op()

    # -- the fused-MoE methods (docs/moe.md's hardware-neutral contract) -------------------------

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                     expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        """``y[t, k, offset + s·N …] (+)= (x[t] @ A_s[l, e]ᵀ) @ B_s[l, e]ᵀ``; no routing weight."""
        self._moe(y, x, lora_a_stacked, lora_b_stacked, topk_ids, adapter_enabled, expert_map, offset, add_inputs, None)

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                    expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        """``y[t, k, offset …] (+)= w[t, k] · (x[t·top_k + k] @ A[l, e]ᵀ) @ B[l, e]ᵀ``."""
        self._moe(y, x, lora_a_stacked, lora_b_stacked, topk_ids, adapter_enabled, expert_map, offset, add_inputs, topk_weights)

    def _moe(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, adapter_enabled, expert_map, offset, add_inputs, weights) -> None:
        top_k = topk_ids.size(1)
        pairs = RoutedPairs.from_routing(self._rows(self.token_rows), topk_ids, expert_map, adapter_enabled, lora_a_stacked[0].size(0))
        routing_weights = None if weights is None else weights.reshape(-1)
        self.engine.moe_into(y.view(-1, y.size(-1)), x, tuple(lora_a_stacked), tuple(lora_b_stacked), pairs, top_k, offset,
                             add_inputs, routing_weights)
        self.engine.layer.after_op()


def _check_slices(lora_b_stacked, output_slices, inputs=None) -> None:
    widths = tuple(as_3d(b).size(1) for b in lora_b_stacked)
    if widths != tuple(output_slices):
        raise ValueError(f"output_slices {tuple(output_slices)} differ from the LoRA-B widths {widths}")
    if inputs is not None and len(inputs) != len(lora_b_stacked):
        raise ValueError(f"inputs have {len(inputs)} slices but {len(lora_b_stacked)} LoRA-B stacks were given")
