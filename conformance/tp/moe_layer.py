"""The MoE LoRA layer under tensor parallelism: its tensors, each rank's shard and what each rank computes
(docs/tensor-parallel.md, *MoE LoRA*); the referee's side is ``conformance.tp.moe_judgement``.

vLLM's ``FusedMoEWithLoRA`` (``vllm/lora/layers/fused_moe.py``) keeps the experts' intermediate
dimension ``I`` sharded, as the base MoE layer does: w13 (gate/up) is column parallel, w2 (down) row
parallel. Per rank ``r`` with ``I_u = I / tp`` rows of the base weight and ``I_p ≥ I_u`` allocated
(``I_p`` padded up to the backend's alignment, the rows past ``I_u`` zeros), not fully sharded:

* w13: LoRA-A whole; each of gate's and up's LoRA-B cut to rows ``[r·I_u, (r+1)·I_u)`` and zero-padded
  to ``I_p`` rows (two slices), or, for the fused ``2·I`` slice of ``FusedMoE3DWithLoRA``, gate's rows
  then zeros then up's rows then zeros (vLLM 0.33 pads w1's part so that w3's starts at ``I_p``, where
  the base w13 weight has it); ``add_lora_w13`` into the rank's ``[T, top_k, 2·I_p]`` output. The
  intermediate stays sharded in vLLM (w2 reads it); the suite gathers it to judge it.
* w2: the rank's input is its ``I_u`` intermediate columns (zeros in the padding), LoRA-A cut to the
  same columns and zero-padded to ``I_p``, LoRA-B whole; ``add_lora_w2`` adds a partial delta (routing
  weight applied) to the rank's partial output; the partial outputs are all-reduced (vLLM reduces the
  MoE layer's output once, after summing the choices; the sum over choices is linear, so the suite
  judges each (token, choice) row before it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from conformance.cases.case import DTYPES

from .moe_case import MoETPCase

Stacks = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class MoETensors:
    """The unsharded MoE LoRA layer. ``x``: w13's ``[T, H]`` hidden states, or w2's ``[T·top_k, I]`` activated
    intermediate; stacks ``[L, E, rows, cols]``; ``y`` the judged output ``[T·top_k, judged_width]`` as the
    base layer left it; the routing ``topk_ids [T, top_k]``, ``topk_weights [T, top_k]`` and
    ``adapter_enabled [L + 1]``."""

    x: torch.Tensor
    lora_a: Stacks
    lora_b: Stacks
    y: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    adapter_enabled: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MoETensors:
        """Every floating-point tensor through ``fn`` (the routing ids and the enabled flags stay as they are)."""
        return replace(self, x=fn(self.x), lora_a=tuple(map(fn, self.lora_a)), lora_b=tuple(map(fn, self.lora_b)),
                       y=fn(self.y), topk_weights=fn(self.topk_weights))

    def to(self, dtype: torch.dtype) -> MoETensors:
        return self.map(lambda tensor: tensor.to(dtype))

    def on(self, device: torch.device) -> MoETensors:
        moved = self.map(lambda tensor: tensor.to(device))
        return replace(moved, topk_ids=self.topk_ids.to(device), adapter_enabled=self.adapter_enabled.to(device))


def moe_tensors(case: MoETPCase) -> MoETensors:
    """The case's tensors in its dtype, drawn in float64 from its seed and rounded once. Every token picks
    ``top_k`` distinct experts (a router's top-k); the routing weights are a softmax, so positive."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    slots, experts, rank, hidden, inter = case.num_slots, case.num_experts, case.max_rank, case.hidden_size, case.intermediate_size
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[: case.top_k] for _ in range(case.num_tokens)]).to(torch.int32)
    topk_weights = torch.softmax(torch.randn(case.num_tokens, case.top_k, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    enabled = torch.ones(slots + 1, dtype=torch.int32)
    enabled[list(case.disabled_slots)] = 0
    enabled[slots] = 0  # vLLM's adapter_enabled has max_loras + 1 entries; the last is never a slot
    if case.layer == "moe_w13":
        x = draw(case.num_tokens, hidden)
        lora_a = tuple(draw(slots, experts, rank, hidden, scale=hidden**-0.5) for _ in range(case.num_slices))
        lora_b = tuple(draw(slots, experts, 2 * inter // case.num_slices, rank, scale=rank**-0.5) for _ in range(case.num_slices))
    else:
        x = draw(case.num_pairs, inter)
        lora_a = (draw(slots, experts, rank, inter, scale=inter**-0.5),)
        lora_b = (draw(slots, experts, hidden, rank, scale=rank**-0.5),)
    y = draw(case.num_pairs, case.judged_width)
    return MoETensors(x, lora_a, lora_b, y, topk_ids, topk_weights, enabled)


# -- each rank's shard (vLLM 0.33's slicing) ----------------------------------------------------------


def _padded(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to ``size`` (vLLM copies a shard into a zeroed stack)."""
    shape = list(tensor.shape)
    shape[dim] = size - tensor.size(dim)
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim).contiguous()


def _rank_rows(case: MoETPCase, rank: int, start: int = 0) -> slice:
    """The intermediate rows ``[start + r·I_u, start + (r+1)·I_u)`` of rank ``r``: the unpadded shard size
    is the stride (vLLM 0.33 ``FusedMoEWithLoRA._tp_shard_size``)."""
    return slice(start + rank * case.shard, start + (rank + 1) * case.shard)


def w13_lora_b_rows(case: MoETPCase, stacks: Stacks, rank: int) -> Stacks:
    """Rank ``rank``'s w13 LoRA-B: each gate/up slice's rows, zero-padded to ``I_p``; a fused ``2·I`` slice as
    gate's rows, zeros, up's rows, zeros (``2·I_p`` rows, up starting at ``I_p``)."""
    if not case.fused_w13:
        return tuple(_padded(stack[:, :, _rank_rows(case, rank)], 2, case.padded_shard) for stack in stacks)
    (fused,) = stacks
    gate = _padded(fused[:, :, _rank_rows(case, rank)], 2, case.padded_shard)
    up = _padded(fused[:, :, _rank_rows(case, rank, case.intermediate_size)], 2, case.padded_shard)
    return (torch.cat([gate, up], dim=2).contiguous(),)


def w2_input_columns(case: MoETPCase, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's intermediate columns (its ``I_u``, zero-padded to ``I_p``) of w2's input or LoRA-A."""
    return _padded(tensor[..., _rank_rows(case, rank)], tensor.dim() - 1, case.padded_shard)


def w13_columns(case: MoETPCase, rank: int) -> list[tuple[str, int, int]]:
    """``(part, start, end)`` of the judged output that make up rank ``rank``'s ``[·, 2·I_p]`` w13 output, in its
    order: gate's shard, gate's padding, up's shard, up's padding. The padding columns of every rank sit
    after the ``2·I`` unsharded ones, rank by rank."""
    pad, inter = case.padding, case.intermediate_size
    padding_start = 2 * inter + rank * 2 * pad
    parts = [
        ("gate", rank * case.shard, (rank + 1) * case.shard),
        ("gate padding", padding_start, padding_start + pad),
        ("up", inter + rank * case.shard, inter + (rank + 1) * case.shard),
        ("up padding", padding_start + pad, padding_start + 2 * pad),
    ]
    return [part for part in parts if part[2] > part[1]]


# -- what each rank computes ------------------------------------------------------------------------


def moe_w13_parallel(case: MoETPCase, t: MoETensors, wrapper, collectives, rank: int) -> torch.Tensor:
    """Column-parallel w13: ``add_lora_w13`` with the whole LoRA-A and the rank's (padded) LoRA-B rows into its
    ``[T, top_k, 2·I_p]`` output; the outputs all-gathered and put back in the judged layout."""
    columns = w13_columns(case, rank)
    y = torch.cat([t.y[:, start:end] for _, start, end in columns], dim=1).contiguous()
    wrapper.add_lora_w13(y.view(case.num_tokens, case.top_k, -1), t.x, t.lora_a, w13_lora_b_rows(case, t.lora_b, rank),
                         t.topk_ids, t.topk_weights, t.adapter_enabled)
    width = y.size(1)
    gathered = collectives.all_gather(y, dim=-1)
    out = t.y.clone()
    for r in range(case.tp_size):
        local = gathered[:, r * width : (r + 1) * width]
        offset = 0
        for _, start, end in w13_columns(case, r):
            out[:, start:end] = local[:, offset : offset + end - start]
            offset += end - start
    return out[None]


def moe_w2_parallel(case: MoETPCase, t: MoETensors, wrapper, collectives, rank: int) -> torch.Tensor:
    """Row-parallel w2: the rank's intermediate columns of the input and of LoRA-A (zero-padded to ``I_p``),
    LoRA-B whole; ``add_lora_w2`` adds the rank's partial delta to its partial output (the base layer's
    partial sums all on rank 0); the outputs all-reduced."""
    x = w2_input_columns(case, t.x, rank)
    lora_a = tuple(w2_input_columns(case, a, rank) for a in t.lora_a)
    y = t.y.clone() if rank == 0 else torch.zeros_like(t.y)
    wrapper.add_lora_w2(y.view(case.num_tokens, case.top_k, -1), x, lora_a, t.lora_b, t.topk_ids, t.topk_weights,
                        t.adapter_enabled)
    return collectives.all_reduce(y)[None]


def moe_composition(case: MoETPCase):
    return moe_w13_parallel if case.layer == "moe_w13" else moe_w2_parallel
