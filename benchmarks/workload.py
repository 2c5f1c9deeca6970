"""One LoRA layer at one shape, as each implementation under benchmark receives it.

A workload is plain data (picklable, so a fresh process can build it); ``build`` turns it into
tensors and a zero-argument callable that runs the op once. Every implementation gets the same op:
``add_lora_linear`` for the linear layers (qkv, gate-up, down), ``add_lora_logits`` for lm_head,
called through the wrapper API the conformance suite tests, with vLLM's 4-D stacks
``[L, 1, R, H]`` / ``[L, 1, N, R]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.reference import NO_ADAPTER

RANK = 16
SCALE = 0.5

# name → (implementation, dtype of every input tensor)
IMPLEMENTATIONS: dict[str, tuple[str, torch.dtype]] = {
    "reference-f64": ("reference", torch.float64),  # the oracle
    "reference-f32": ("reference", torch.float32),  # the low-precision baseline path
    "vllm-cpu": ("cpu", torch.float32),  # vLLM's PunicaWrapperCPU over vllm.lora.ops.torch_ops
    "hpu-mask": ("hpu-emulated", torch.float32),  # the suite's Gaudi code, dense mask, on the CPU
    "hpu-gather": ("hpu-emulated-gather", torch.float32),  # the index_select variant, on the CPU
}


@dataclass(frozen=True)
class Workload:
    layer: str  # e.g. "llama3-8b qkv"
    hidden: int  # H, the input width
    slices: tuple[int, ...]  # N_s, the output widths (one for lm_head)
    tokens: int  # T: rows of the op (sampled rows for lm_head)
    adapters: int  # L: adapter slots in the stacks, all used by some rows
    implementation: str  # a key of IMPLEMENTATIONS
    logits: bool = False  # lm_head: add_lora_logits instead of add_lora_linear

    @property
    def out_width(self) -> int:
        return sum(self.slices)


def slot_per_row(tokens: int, adapters: int) -> list[int]:
    """Slots of a mixed batch: 16 sequences (one row each when fewer rows) cycling −1, 0, …, L−1.

    So rows without adapter (−1) are always mixed in, except at T = 1, which uses slot 0.
    """
    if tokens == 1:
        return [0]
    cycle = [NO_ADAPTER, *range(adapters)]
    sequences = min(16, tokens)
    return [cycle[(t * sequences // tokens) % len(cycle)] for t in range(tokens)]


def _target(implementation: str):
    name, _ = IMPLEMENTATIONS[implementation]
    if name == "reference":
        from conformance.reference import PunicaWrapperReference

        return PunicaWrapperReference("cpu")
    from conformance.targets import registry

    return registry.load(name)


def build(w: Workload):
    """Tensors and a callable running the op once; the wrapper's metadata is set up here, not timed."""
    from conformance.reference import LoRAMapping

    _, dtype = IMPLEMENTATIONS[w.implementation]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(w.tokens, w.hidden, generator=g).to(dtype)
    y = torch.full((w.tokens, w.out_width), 0.25, dtype=dtype)  # full, not zeros: pages must be resident now
    a = [torch.randn(w.adapters, 1, RANK, w.hidden, generator=g).to(dtype) / w.hidden**0.5 for _ in w.slices]
    b = [torch.randn(w.adapters, 1, n, RANK, generator=g).to(dtype) / RANK**0.5 for n in w.slices]
    slots = tuple(slot_per_row(w.tokens, w.adapters))
    prefill = w.tokens > 64 and not w.logits  # vLLM's CPU wrapper then takes its sgmv path
    seq_lens = (w.tokens // 16,) * 16 if prefill and w.tokens % 16 == 0 else (1,) * w.tokens
    mapping = LoRAMapping(slots, slots, seq_lens, prefill, w.adapters)
    target = _target(w.implementation)
    target.update_metadata(mapping)
    if w.logits:
        return lambda: target.add_lora_logits(y, x, a[0], b[0], SCALE)
    return lambda: target.add_lora_linear(y, x, tuple(a), tuple(b), SCALE, w.slices)
