"""One fused-MoE LoRA call (``add_lora_w13`` or ``add_lora_w2``) at one shape, as each implementation receives it.

Like :mod:`benchmarks.workload`, a workload is plain data (picklable, so a fresh process can build it)
and :func:`build` turns it into tensors and a zero-argument callable that runs the op once, through
the hardware-neutral wrapper contract of docs/moe.md::

    add_lora_w13(y [T, top_k, 2I], x [T, H], A (2 × [L, E, R, H]), B (2 × [L, E, I, R]), topk_ids, topk_weights, adapter_enabled)
    add_lora_w2 (y [T, top_k, H], x [T·top_k, I], A (1 × [L, E, R, I]), B (1 × [L, E, H, R]), …)

gate and up are two slices of ``I`` (``FusedMoEWithLoRA``). The batch: the slots of
:func:`benchmarks.workload.slot_per_row` (16 sequences cycling −1, 0, …, L−1: a quarter of the tokens
without adapter at L = 4; T = 1 uses slot 0), each token routed to ``top_k`` distinct experts drawn at
random (seeded), routing weights a softmax of random logits, every adapter enabled.

:class:`PlainGather` is the comparison baseline written here, not a suite target: the obvious
per-(token, choice) implementation, which copies every served pair's A and B out of the stacks and
multiplies with ``bmm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .workload import slot_per_row

RANK = 16
ADAPTERS = 4

# name → (implementation, dtype of every input tensor but the routing)
IMPLEMENTATIONS: dict[str, tuple[str, torch.dtype]] = {
    "reference-f64": ("reference", torch.float64),  # the oracle
    "reference-f32": ("reference", torch.bfloat16),  # bf16 case inputs: the reference accumulates in float32
    "hpu-grouped": ("hpu-emulated", torch.bfloat16),  # the suite's Gaudi code, grouped MoE variant (its default)
    "hpu-mask": ("hpu-emulated", torch.bfloat16),  # the suite's Gaudi code, dense mask over L·E·R columns
    "hpu-gather": ("hpu-emulated-gather", torch.bfloat16),  # the index_select variant
    "plain-gather": ("plain-gather", torch.bfloat16),  # the baseline below
}
# the HPU implementations' MoE variant (the targets' moe_variant option)
HPU_MOE_VARIANTS = {"hpu-grouped": "grouped", "hpu-mask": "mask", "hpu-gather": "gather"}


@dataclass(frozen=True)
class MoEWorkload:
    model: str  # e.g. "Mixtral-8x7B"
    hidden: int  # H
    intermediate: int  # I (per expert)
    experts: int  # E (local = global: no expert parallelism)
    top_k: int
    op: str  # "w13" or "w2"
    tokens: int  # T
    implementation: str  # a key of IMPLEMENTATIONS
    adapters: int = ADAPTERS  # L
    rank: int = RANK  # R

    @property
    def slices(self) -> int:
        return 2 if self.op == "w13" else 1

    @property
    def in_width(self) -> int:
        """K: the LoRA-A input width (H for w13, I for w2)."""
        return self.hidden if self.op == "w13" else self.intermediate

    @property
    def out_width(self) -> int:
        """N: the width of one output slice (I for w13, H for w2)."""
        return self.intermediate if self.op == "w13" else self.hidden

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def dtype(self) -> torch.dtype:
        return IMPLEMENTATIONS[self.implementation][1]


def routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, top_k], topk_weights float32 [T, top_k]): distinct random experts per token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.randn(tokens, top_k, generator=g).softmax(dim=1)
    return ids, weights


def mapping_for(tokens: int, adapters: int):
    from conformance.reference import LoRAMapping

    slots = tuple(slot_per_row(tokens, adapters))
    seq_lens = (tokens // 16,) * 16 if tokens % 16 == 0 and tokens >= 16 else (1,) * tokens
    return LoRAMapping(slots, slots, seq_lens, True, adapters)


def tensors(w: MoEWorkload) -> dict:
    """The op's inputs; ``y`` is full (0.25), so that its pages are resident before the call is measured."""
    dtype = w.dtype
    g = torch.Generator().manual_seed(1)
    shape_a = (w.adapters, w.experts, w.rank, w.in_width)
    shape_b = (w.adapters, w.experts, w.out_width, w.rank)
    a = tuple((torch.randn(shape_a, generator=g) / w.in_width**0.5).to(dtype) for _ in range(w.slices))
    b = tuple((torch.randn(shape_b, generator=g) / w.rank**0.5).to(dtype) for _ in range(w.slices))
    rows = w.tokens if w.op == "w13" else w.pairs
    x = torch.randn(rows, w.in_width, generator=g).to(dtype)
    y = torch.full((w.tokens, w.top_k, w.slices * w.out_width), 0.25, dtype=dtype)
    topk_ids, topk_weights = routing(w.tokens, w.experts, w.top_k)
    adapter_enabled = torch.ones(w.adapters + 1, dtype=torch.int32)
    return {"y": y, "x": x, "a": a, "b": b, "topk_ids": topk_ids, "topk_weights": topk_weights, "adapter_enabled": adapter_enabled}


def target_for(implementation: str):
    name, _ = IMPLEMENTATIONS[implementation]
    if name == "reference":
        from conformance.reference import PunicaWrapperReference

        return PunicaWrapperReference("cpu")
    if name == "plain-gather":
        return PlainGather()
    from conformance.targets import registry

    return registry.resolve(name)(moe_variant=HPU_MOE_VARIANTS[implementation])


def build(w: MoEWorkload, inputs: dict | None = None):
    """A callable running the op once; the wrapper's metadata is set up here, not timed."""
    t = inputs if inputs is not None else tensors(w)
    target = target_for(w.implementation)
    target.update_metadata(mapping_for(w.tokens, w.adapters))
    method = target.add_lora_w13 if w.op == "w13" else target.add_lora_w2
    return lambda: method(t["y"], t["x"], t["a"], t["b"], t["topk_ids"], t["topk_weights"], t["adapter_enabled"])


class PlainGather:
    """The per-(token, choice) gather baseline: docs/moe.md's contract, written the obvious way.

    For the served pairs only (a data-dependent set: this is a CPU baseline, not a static-shape
    design): copy each pair's ``A[slot, expert]`` ``[R, K]`` and ``B[slot, expert]`` ``[N, R]`` out of the
    stacks (``[P, R, K]`` and ``[P, N, R]``: ``P·R·(K + N)`` elements per slice), upcast them to float32,
    and multiply with ``bmm``. Rounding as the contract states: the shrink intermediate rounded to the
    output dtype, the routing weight (w2) applied to the float32 delta before it is rounded.
    """

    def update_metadata(self, mapping) -> None:
        self.slots = mapping.token_slot_tensor()
        self.num_slots = mapping.num_slots

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                     expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        self._moe(y, x, lora_a_stacked, lora_b_stacked, topk_ids, None, adapter_enabled, expert_map, offset, add_inputs)

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                    expert_map=None, offset: int = 0, add_inputs: bool = True, **kwargs) -> None:
        self._moe(y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, expert_map, offset, add_inputs)

    def _moe(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, weights, adapter_enabled, expert_map, offset, add_inputs) -> None:
        top_k = topk_ids.size(1)
        num_slots = lora_a_stacked[0].size(0)
        slots = self.slots.repeat_interleave(top_k)
        experts = topk_ids.reshape(-1).long()
        if expert_map is not None:
            experts = expert_map.long()[experts]
        enabled = adapter_enabled.long()[slots.clamp(0, num_slots - 1)] != 0
        served = torch.nonzero((slots >= 0) & (slots < num_slots) & enabled & (experts >= 0)).flatten()
        if served.numel() == 0:
            return
        acc = torch.float64 if any(t.dtype == torch.float64 for t in (y, x, *lora_a_stacked, *lora_b_stacked)) else torch.float32
        inputs = x[served // top_k if weights is None else served].to(acc)  # [P, K]
        slot, expert = slots[served], experts[served]
        out = y.view(-1, y.size(-1))
        width = lora_b_stacked[0].size(2)
        for s, (a, b) in enumerate(zip(lora_a_stacked, lora_b_stacked, strict=True)):
            a_rows = a[slot, expert if a.size(1) > 1 else 0].to(acc)  # [P, R, K]: a copy per pair
            shrunk = torch.bmm(a_rows, inputs.unsqueeze(-1)).squeeze(-1).to(y.dtype)  # [P, R]
            del a_rows
            b_rows = b[slot, expert if b.size(1) > 1 else 0].to(acc)  # [P, N, R]: a copy per pair
            delta = torch.bmm(b_rows, shrunk.to(acc).unsqueeze(-1)).squeeze(-1)  # [P, N]
            del b_rows
            if weights is not None:
                delta = delta * weights.reshape(-1)[served].to(acc)[:, None]
            delta = delta.to(y.dtype)
            columns = slice(offset + s * width, offset + (s + 1) * width)
            if add_inputs:
                out[served, columns] += delta
            else:
                out[served, columns] = delta
