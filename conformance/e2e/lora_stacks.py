"""Adapters placed in slots: the stacked weights a target's wrapper methods take, per call site.

vLLM packs q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``; each packed module is one
``add_lora_linear`` call with one slice per sub-module. In a parallel block (a Cohere) the five share one
input, and the decoder packs them as a backend that fuses them would: one ``qkv_gate_up_proj`` call of
5 slices (vLLM's own Cohere still makes two calls, ``qkv_proj`` and ``gate_up_proj``). Stacks are
``[num_slots, 1, rank, in]`` (A) and ``[num_slots, 1, out, rank]`` (B), zero where a slot is empty, where
its adapter does not target the module, and in the rank columns beyond the module's own rank (an adapter
with a ``rank_pattern`` has ranks that differ from module to module). Each module's own scaling
(``ModuleDelta.scaling``: ``alpha_pattern`` and ``rank_pattern`` applied) is folded into its B (in float64,
then rounded once to the run's dtype), as vLLM does when it loads an adapter, so the wrapper methods are
called with ``scale=1``.

A Mixtral layer has no dense MLP: its experts are one ``add_lora_w13`` and one ``add_lora_w2`` call
(docs/moe.md), with per-expert stacks ``[num_slots, E, rank, in]`` and ``[num_slots, E, out, rank]``.
PEFT's adapters on the fused ``gate_up_proj`` are one slice of width ``2·I`` (vLLM's
``FusedMoE3DWithLoRA``), and ``adapter_enabled[slot]`` is 1 where the slot's adapter has expert LoRA.

A token classifier's adapters may save a whole head (``modules_to_save``): vLLM 0.33's token head layer
holds those as one stack ``[num_slots, 1, labels, hidden]`` (zero where a slot's adapter saved none),
their biases ``[num_slots, labels]`` and a flag per slot (:class:`HeadStack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapters import EXPERT_PARAMETERS, Adapter
from .checkpoint import ModelConfig, expert_shape, linear_shape

# Call sites of a decoder layer: packed module → the sub-modules that are its output slices.
ATTENTION_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
}
PACKED_MODULES = {
    **ATTENTION_MODULES,
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# A parallel block: every projection of the norm's output in one call, slices of widths (H, kv, kv, I, I).
PARALLEL_MODULES = {
    "qkv_gate_up_proj": ATTENTION_MODULES["qkv_proj"] + PACKED_MODULES["gate_up_proj"],
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}


def packed_modules(model: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The ``add_lora_linear`` call sites of one layer: a Mixtral's MLP is its experts instead, a parallel
    block's q/k/v/gate/up are one call."""
    if model.experts is not None:
        return ATTENTION_MODULES
    return PARALLEL_MODULES if model.parallel is not None else PACKED_MODULES


@dataclass(frozen=True)
class LinearSite:
    """The arguments of one ``add_lora_linear`` call (one slice per packed sub-module)."""

    lora_a: tuple[torch.Tensor, ...]
    lora_b: tuple[torch.Tensor, ...]
    output_slices: tuple[int, ...]


@dataclass(frozen=True)
class ExpertsSite:
    """The LoRA arguments of one layer's ``add_lora_w13`` and ``add_lora_w2`` calls."""

    w13_lora_a: tuple[torch.Tensor, ...]  # ([slots, E, rank, hidden],): one fused gate/up slice
    w13_lora_b: tuple[torch.Tensor, ...]  # ([slots, E, 2·I, rank],)
    w2_lora_a: tuple[torch.Tensor, ...]  # ([slots, E, rank, I],)
    w2_lora_b: tuple[torch.Tensor, ...]  # ([slots, E, hidden, rank],)
    adapter_enabled: torch.Tensor  # int32 [slots + 1]: 1 where the slot's adapter has expert LoRA here


@dataclass(frozen=True)
class HeadStack:
    """The saved heads of a token classifier's slots, the stack an ``add_shrink`` call takes whole."""

    weight: torch.Tensor  # [slots, 1, labels, hidden]: the head's weight as a "LoRA-A" of rank = labels
    bias: torch.Tensor  # [slots, labels]
    enabled: torch.Tensor  # bool [slots]: the slot's adapter saved a head

    @classmethod
    def build(cls, adapters: tuple[Adapter | None, ...], model: ModelConfig, dtype: torch.dtype, device) -> HeadStack:
        weight = torch.zeros(len(adapters), 1, model.num_labels, model.hidden_size, dtype=torch.float64)
        bias = torch.zeros(len(adapters), model.num_labels, dtype=torch.float64)
        for slot, adapter in enumerate(adapters):
            if adapter is not None and adapter.head is not None:
                weight[slot, 0], bias[slot] = adapter.head.weight.double(), adapter.head.bias.double()
        enabled = torch.tensor([a is not None and a.head is not None for a in adapters], device=device)
        return cls(weight.to(device=device, dtype=dtype), bias.to(device=device, dtype=dtype), enabled)


@dataclass(frozen=True)
class LoRAStacks:
    slots: tuple[str | None, ...]  # adapter name per slot (None = empty slot)
    max_rank: int
    layers: tuple[dict[str, LinearSite], ...]
    embedding_a: torch.Tensor  # [num_slots, vocab, rank]: the rows the layer looks up per token
    embedding_b: torch.Tensor  # [num_slots, 1, hidden, rank]
    lm_head: LinearSite
    experts: tuple[ExpertsSite, ...] = ()  # per layer, for a Mixtral
    head: HeadStack | None = None  # for a token classifier

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @classmethod
    def build(cls, adapters: tuple[Adapter | None, ...], model: ModelConfig, dtype: torch.dtype, device,
              max_rank: int | None = None) -> LoRAStacks:
        """``max_rank``: the stacks' rank width (default: the largest rank of ``adapters``; a served engine
        sizes its stacks once for every adapter it may load, as vLLM's ``max_lora_rank``)."""
        max_rank = max_rank or max((a.max_rank for a in adapters if a is not None), default=1)

        def stack(layer: int | None, module: str, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
            return _stack(adapters, layer, module, shape, max_rank, dtype, device)

        def site(layer: int | None, modules: tuple[str, ...]) -> LinearSite:
            stacks = [stack(layer, m, (1, *linear_shape(model, m))) for m in modules]
            return LinearSite(
                lora_a=tuple(a for a, _ in stacks),
                lora_b=tuple(b for _, b in stacks),
                output_slices=tuple(b.size(2) for _, b in stacks),
            )

        def experts_site(layer: int) -> ExpertsSite:
            (w13_a, w13_b), (w2_a, w2_b) = (stack(layer, f"experts.{p}", expert_shape(model, p)) for p in EXPERT_PARAMETERS)
            enabled = [int(a is not None and any(a.delta(layer, f"experts.{p}") for p in EXPERT_PARAMETERS)) for a in adapters]
            return ExpertsSite((w13_a,), (w13_b,), (w2_a,), (w2_b,), torch.tensor(enabled + [0], dtype=torch.int32, device=device))

        layers = tuple(
            {packed: site(layer, modules) for packed, modules in packed_modules(model).items()}
            for layer in range(model.num_hidden_layers)
        )
        # PEFT's embedding A is [r, vocab]: stacked like a linear A, then transposed into rows per token
        embedding_a, embedding_b = stack(None, "embed_tokens", (1, model.hidden_size, model.vocab_size))
        return cls(
            slots=tuple(a.name if a is not None else None for a in adapters),
            max_rank=max_rank,
            layers=layers,
            embedding_a=embedding_a[:, 0].transpose(1, 2).contiguous(),
            embedding_b=embedding_b,
            lm_head=site(None, ("lm_head",)),
            experts=tuple(experts_site(layer) for layer in range(model.num_hidden_layers)) if model.experts else (),
            head=HeadStack.build(adapters, model, dtype, device) if model.num_labels is not None else None,
        )


def _stack(adapters, layer, module, shape, max_rank, dtype, device):
    """A and B stacks of one module, ``shape = (experts, out, in)``: a dense module is one expert."""
    experts, out_features, in_features = shape
    a_stack = torch.zeros(len(adapters), experts, max_rank, in_features, dtype=torch.float64)
    b_stack = torch.zeros(len(adapters), experts, out_features, max_rank, dtype=torch.float64)
    for slot, adapter in enumerate(adapters):
        delta = adapter.delta(layer, module) if adapter is not None else None
        if delta is not None:  # a dense delta ([r, in], [out, r]) broadcasts over the one expert
            a_stack[slot, :, : delta.rank] = delta.a.double()
            b_stack[slot, :, :, : delta.rank] = delta.b.double() * delta.scaling
    return a_stack.to(device=device, dtype=dtype), b_stack.to(device=device, dtype=dtype)


def stack_tensors(stacks: LoRAStacks) -> list[torch.Tensor]:
    """Every tensor of ``stacks``, in a fixed order (two stacks built alike list theirs alike)."""
    found: list[torch.Tensor] = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for key in sorted(value):
                walk(value[key])
        elif hasattr(value, "__dataclass_fields__"):
            for name in value.__dataclass_fields__:
                walk(getattr(value, name))

    walk(stacks)
    return found


def load_in_place(persistent: LoRAStacks, stacks: LoRAStacks) -> None:
    """Write ``stacks`` (the adapters of a batch, same slots and rank width) into ``persistent``'s tensors, in
    place: what vLLM does when it activates adapters into the stacked buffers a captured graph reads."""
    for into, value in zip(stack_tensors(persistent), stack_tensors(stacks), strict=True):
        into.copy_(value)
