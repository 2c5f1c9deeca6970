"""The HPU implementation as a vLLM ``PunicaWrapperBase`` subclass: a drop-in punica wrapper for Gaudi.

``make_vllm_punica_wrapper_class()`` builds (and caches) a class deriving from the *installed* vLLM's
``vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase``, so vLLM is imported only when it is called.
The class keeps the base's ``update_metadata`` (vLLM's index buffers still feed the embedding A-lookup
and the extra-vocab logits, docs/gaudi-lora.md §2), then builds this implementation's row state
from the base's ``token_lora_indices`` and ``sampler_indices`` on the device: no host loop, no global
mask. Its ``add_*`` methods are :class:`wrapper.HpuPunicaWrapper`'s.

Fused-MoE LoRA (``add_lora_w13`` / ``add_lora_w2`` in vLLM's own signatures) goes through the same
engine (docs/moe.md); vllm-gaudi has none. Compared with vllm-gaudi's ``PunicaWrapperHPU`` it needs no
model-runner-built ``LoraMask`` global,
implements ``add_shrink`` / ``add_expand`` (``offset_start``, ``add_inputs``), LoRA bias (the
keyword ``lora_bias_stacked``; current vLLM passes none) and
``add_inputs=False`` for embeddings, and keeps NaN/Inf of unused slots out of other rows.

Device: ``hpu`` (the Habana runtime must load, see ``device``) or ``cpu`` (the emulation, used by the
tests). Options: ``variant`` (``"mask"`` | ``"gather"``), ``moe_variant`` (``"grouped"``, the default, |
``"mask"`` | ``"gather"``: docs/hpu.md, MoE) and ``buckets``.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .buckets import BucketPolicy
from .device import CpuDeviceLayer, HpuDeviceLayer, graphs_requested, load_runtime, requested_mode
from .engine import LoRAEngine
from .wrapper import HpuPunicaWrapper


def device_layer_for(device: torch.device | str):
    device = torch.device(device)
    if device.type == "hpu":
        return HpuDeviceLayer(load_runtime(requested_mode(), "vllm punica wrapper"), requested_mode(), graphs_requested())
    if device.type == "cpu":
        return CpuDeviceLayer()
    raise ValueError(f"the HPU punica wrapper runs on 'hpu' (Gaudi) or 'cpu' (emulation), not on {device}")


@functools.cache
def make_vllm_punica_wrapper_class(variant: str = "mask", buckets: BucketPolicy | None = None, moe_variant: str = "grouped") -> type:
    """A ``PunicaWrapperBase`` subclass whose LoRA math is this package's (vLLM must be importable): the dense
    ops by ``variant``, the fused-MoE ones by ``moe_variant`` (grouped by default, as the ``hpu`` targets)."""
    base = importlib.import_module("vllm.lora.punica_wrapper.punica_base").PunicaWrapperBase

    class PunicaWrapperHPUMasked(base):
        """vLLM punica wrapper over this project's mask-based HPU LoRA implementation."""

        def __init__(self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str, **kwargs):
            base.__init__(self, max_num_batched_tokens, max_batches, device, **kwargs)
            self.hpu = HpuPunicaWrapper(LoRAEngine(variant, buckets, device_layer_for(device), moe_variant))

        def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, *args, **kwargs):
            base.update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, *args, **kwargs)
            self.hpu.set_slots(self.token_lora_indices, self.sampler_indices)

        def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
            self.hpu.add_shrink(y, x, lora_a_stacked, scale, **kwargs)

        def add_expand(
            self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, *, lora_bias_stacked=None, **kwargs
        ):
            self.hpu.add_expand(
                y, x, lora_b_stacked, output_slices, offset_start, add_inputs, lora_bias_stacked=lora_bias_stacked, **kwargs
            )

        def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
            self.hpu.add_lora_embedding(y, x, lora_b_stacked, add_inputs, **kwargs)

        def add_lora_linear(
            self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, lora_bias_stacked=None, **kwargs
        ):
            self.hpu.add_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                buffer=buffer, lora_bias_stacked=lora_bias_stacked, **kwargs,
            )

        def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
            self.hpu.add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)

        # -- fused-MoE LoRA in vLLM's signatures (0.32: PunicaWrapperGPU's), over the neutral methods --
        # w13 returns the naive form, (None, the pairs' local experts, None, token slots), which vLLM's
        # layer hands back to w2 unchanged: no sorted ids, so no Triton tile config is ever looked up.

        def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1, w2, num_tokens,
                         top_k_num, max_loras, adapter_enabled, local_num_experts, top_k, num_slices, fully_sharded,
                         use_tuned_config, add_inputs=True, token_lora_mapping=None):
            _refuse_other_token_mapping(token_lora_mapping)
            self.hpu.add_lora_w13(y.view(-1, top_k_num, y.size(-1)), x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights,
                                  adapter_enabled, expert_map=expert_map, add_inputs=add_inputs)
            local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
            return None, local.reshape(-1).to(torch.int32), None, None

        def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora, expert_ids_lora,
                        num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2, top_k_num, max_loras,
                        adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config, add_inputs=True):
            _refuse_other_token_mapping(token_lora_mapping)
            if sorted_token_ids_lora is not None:
                raise ValueError("add_lora_w2 takes the naive metadata this wrapper's add_lora_w13 returned (no sorted ids)")
            offset = lora_b_stacked[0].size(-2) * tp_rank if fully_sharded else 0
            local_experts = expert_ids_lora.reshape(-1, top_k_num)
            self.hpu.add_lora_w2(y, x, lora_a_stacked, lora_b_stacked, local_experts, topk_weights, adapter_enabled,
                                 offset=offset, add_inputs=add_inputs)

        if hasattr(base, "_select_full_linear_output"):

            def apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
                """Request-routed full linear weights (vLLM ≥ 0.32, classification heads), over the sampled rows."""
                self.hpu.apply_lora_full_linear(y, x, weight_stacked, bias_stacked, module_enabled)

    # Abstract methods a newer vLLM adds (MoE LoRA, …) are not implemented; say so instead of failing to instantiate.
    for name in sorted(getattr(PunicaWrapperHPUMasked, "__abstractmethods__", ())):
        setattr(PunicaWrapperHPUMasked, name, _not_implemented(name))
    PunicaWrapperHPUMasked.__abstractmethods__ = frozenset()
    return PunicaWrapperHPUMasked


def _refuse_other_token_mapping(token_lora_mapping) -> None:
    """Expert parallelism with all-to-all dispatch passes a per-rank token → LoRA map; not supported yet."""
    if token_lora_mapping is not None:
        raise NotImplementedError("a per-rank token_lora_mapping (EP + LoRA all-to-all dispatch) is not supported by the HPU wrapper")


def _not_implemented(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"{name} is not implemented by the HPU mask-based punica wrapper")

    method.__name__ = name
    return method
