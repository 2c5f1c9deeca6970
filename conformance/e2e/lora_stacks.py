"""Adapters placed in slots: the stacked weights a target's wrapper methods take, per call site.

vLLM packs q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``; each packed module is one
``add_lora_linear`` call with one slice per sub-module. Stacks are ``[num_slots, 1, rank, in]`` (A)
and ``[num_slots, 1, out, rank]`` (B), zero where a slot is empty, where its adapter does not target
the module, and in the rank columns beyond the adapter's own rank. The adapter's scaling is folded into
B (in float64, then rounded once to the run's dtype), as vLLM does when it loads an adapter, so the
wrapper methods are called with ``scale=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapters import Adapter, ModuleDelta
from .checkpoint import ModelConfig, linear_shape

# Call sites of a decoder layer: packed module → the sub-modules that are its output slices.
PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class LinearSite:
    """The arguments of one ``add_lora_linear`` call (one slice per packed sub-module)."""

    lora_a: tuple[torch.Tensor, ...]
    lora_b: tuple[torch.Tensor, ...]
    output_slices: tuple[int, ...]


@dataclass(frozen=True)
class LoRAStacks:
    slots: tuple[str | None, ...]  # adapter name per slot (None = empty slot)
    max_rank: int
    layers: tuple[dict[str, LinearSite], ...]
    embedding_a: torch.Tensor  # [num_slots, vocab, rank]: the rows the layer looks up per token
    embedding_b: torch.Tensor  # [num_slots, 1, hidden, rank]
    lm_head: LinearSite

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @classmethod
    def build(cls, adapters: tuple[Adapter | None, ...], model: ModelConfig, dtype: torch.dtype, device) -> LoRAStacks:
        max_rank = max((a.rank for a in adapters if a is not None), default=1)

        def site(layer: int | None, modules: tuple[str, ...]) -> LinearSite:
            stacks = [_linear_stack(adapters, layer, m, linear_shape(model, m), max_rank, dtype, device) for m in modules]
            return LinearSite(
                lora_a=tuple(a for a, _ in stacks),
                lora_b=tuple(b for _, b in stacks),
                output_slices=tuple(b.size(2) for _, b in stacks),
            )

        layers = tuple(
            {packed: site(layer, modules) for packed, modules in PACKED_MODULES.items()}
            for layer in range(model.num_hidden_layers)
        )
        embedding_a, embedding_b = _embedding_stack(adapters, model, max_rank, dtype, device)
        return cls(
            slots=tuple(a.name if a is not None else None for a in adapters),
            max_rank=max_rank,
            layers=layers,
            embedding_a=embedding_a,
            embedding_b=embedding_b,
            lm_head=site(None, ("lm_head",)),
        )


def _scaled_b(adapter: Adapter, delta: ModuleDelta) -> torch.Tensor:
    return delta.b.double() * adapter.scaling


def _linear_stack(adapters, layer, module, shape, max_rank, dtype, device):
    out_features, in_features = shape
    a_stack = torch.zeros(len(adapters), 1, max_rank, in_features, dtype=torch.float64)
    b_stack = torch.zeros(len(adapters), 1, out_features, max_rank, dtype=torch.float64)
    for slot, adapter in enumerate(adapters):
        delta = adapter.delta(layer, module) if adapter is not None else None
        if delta is not None:
            a_stack[slot, 0, : adapter.rank] = delta.a.double()
            b_stack[slot, 0, :, : adapter.rank] = _scaled_b(adapter, delta)
    return a_stack.to(device=device, dtype=dtype), b_stack.to(device=device, dtype=dtype)


def _embedding_stack(adapters, model: ModelConfig, max_rank, dtype, device):
    a_rows = torch.zeros(len(adapters), model.vocab_size, max_rank, dtype=torch.float64)
    b_stack = torch.zeros(len(adapters), 1, model.hidden_size, max_rank, dtype=torch.float64)
    for slot, adapter in enumerate(adapters):
        delta = adapter.delta(None, "embed_tokens") if adapter is not None else None
        if delta is not None:
            a_rows[slot, :, : adapter.rank] = delta.a.double().T  # PEFT's A is [r, vocab]
            b_stack[slot, 0, :, : adapter.rank] = _scaled_b(adapter, delta)
    return a_rows.to(device=device, dtype=dtype), b_stack.to(device=device, dtype=dtype)
