"""LoRA weight stacks: their layouts, the flattened forms the HPU math uses, and a cache of those forms.

vLLM hands every LoRA op whole *stacks*, one matrix per adapter slot (a legacy ``num_layers`` dim of
size 1 may sit in dim 1):

* LoRA-A ``[L, (1,) R, H]``: ``A[l]`` is PEFT's ``lora_A.weight``, applied as ``x @ A[l]ᵀ``;
* LoRA-B ``[L, (1,) N, R]``: ``B[l]`` is PEFT's ``lora_B.weight``, applied as ``s @ B[l]ᵀ``;
* LoRA bias ``[L, (1,) N]``.

The mask-based math wants the stacks *flattened* so that all adapters act as one matrix
(``A_flat [L·R, H]``, row ``l·R + r`` = ``A[l, r]``; ``B_flat [L·R, N]``, row ``l·R + r`` = ``B[l, :, r]``);
the gather-based math wants them 3-D. Both want them in the accumulation dtype (float32), because
vLLM's kernels multiply low-precision operands into float32 accumulators and a float32 GEMM on
upcast operands is the portable way to get the same numbers.

Re-laying out a stack on every call would cost a copy of every adapter per layer per step, so the
prepared form is made once per adapter set and cached (:class:`PreparedStacks`). The cache key is
the stack's *identity and version*, never its ``data_ptr`` alone: vLLM bug #50820 (a pointer cache
keyed by ``data_ptr``) served stale entries when a new tensor reused the memory or the same memory was
viewed differently. Here an entry is valid only while

* the very same tensor object is alive (checked through a weak reference, so a new tensor that lands
  at a recycled address or ``id`` never matches), and
* its version counter (``tensor._version``, bumped by every in-place write such as vLLM's
  ``set_lora`` / ``reset_lora``), shape, strides, storage offset, dtype and device are unchanged.

Tensors created under ``torch.inference_mode()`` keep no version counter; they are prepared on every
call (correct, just not cached). Writes through ``tensor.data`` bypass the version counter in PyTorch
and are not detected: load adapters through the stack itself, as vLLM does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

# as_3d and accumulation_dtype repeat two small helpers of conformance.reference on purpose: the
# implementation under test shares no code with the oracle that judges it.


def as_3d(stack: torch.Tensor) -> torch.Tensor:
    """The stack as ``[L, rows, cols]``, dropping vLLM's legacy ``num_layers`` dimension of size 1."""
    if stack.ndim == 4:
        if stack.size(1) != 1:
            raise ValueError(f"a 4-D LoRA stack must have size 1 in dim 1 (num_layers), got {tuple(stack.shape)}")
        return stack.squeeze(1)
    if stack.ndim != 3:
        raise ValueError(f"a LoRA stack must be 3-D [L, rows, cols] or 4-D [L, 1, rows, cols], got {tuple(stack.shape)}")
    return stack


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, what vLLM's LoRA kernels accumulate in; float64 when an operand is float64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# -- the prepared layouts (pure functions of the stack) ----------------------------------------
# Always a copy, never a view: a view keeps the stack's storage and impl alive, so a cached view
# would pin every stack ever seen (its weak reference would never die).


def flat_a(stack: torch.Tensor) -> torch.Tensor:
    """LoRA-A ``[L, (1,) R, H]`` → ``[L·R, H]`` in the accumulation dtype: row ``l·R + r`` is ``A[l, r]``."""
    a = as_3d(stack)
    return a.reshape(a.size(0) * a.size(1), a.size(2)).to(accumulation_dtype(a), copy=True).contiguous()


def flat_b(stack: torch.Tensor) -> torch.Tensor:
    """LoRA-B ``[L, (1,) N, R]`` → ``[L·R, N]`` in the accumulation dtype: row ``l·R + r`` is ``B[l, :, r]``."""
    b = as_3d(stack)
    return b.transpose(1, 2).reshape(b.size(0) * b.size(2), b.size(1)).to(accumulation_dtype(b), copy=True).contiguous()


def upcast_3d(stack: torch.Tensor) -> torch.Tensor:
    """Any stack as ``[L, rows, cols]`` in the accumulation dtype (the gather-based layout)."""
    s = as_3d(stack)
    return s.to(accumulation_dtype(s), copy=True).contiguous()


def experts_as_slots(stack: torch.Tensor) -> torch.Tensor:
    """An MoE stack ``[L, E, rows, cols]`` as a dense one of ``L·E`` virtual slots: slot ``l·E + e`` is
    adapter ``l``'s matrix for expert ``e``. A stack of expert dim 1 (shared), or one expanded to every
    expert with stride 0 as vLLM's layer passes it, is kept at one virtual slot per adapter."""
    if stack.ndim != 4:
        raise ValueError(f"an MoE LoRA stack is 4-D [L, E, rows, cols], got {tuple(stack.shape)}")
    if stack.stride(1) == 0:
        stack = stack[:, :1]
    return stack.reshape(stack.size(0) * stack.size(1), stack.size(2), stack.size(3))


def moe_flat_a(stack: torch.Tensor) -> torch.Tensor:
    """MoE LoRA-A ``[L, E, R, K]`` → ``[L·E·R, K]``: ``flat_a`` of its virtual slots."""
    return flat_a(experts_as_slots(stack))


def moe_flat_b(stack: torch.Tensor) -> torch.Tensor:
    """MoE LoRA-B ``[L, E, N, R]`` → ``[L·E·R, N]``: ``flat_b`` of its virtual slots."""
    return flat_b(experts_as_slots(stack))


def moe_upcast_3d(stack: torch.Tensor) -> torch.Tensor:
    """MoE stack → ``[L·E, rows, cols]`` in the accumulation dtype (the gather-based layout)."""
    return upcast_3d(experts_as_slots(stack))


def experts_of(stack: torch.Tensor) -> int:
    """How many experts a stack distinguishes: 1 when shared (expert dim 1 or stride 0)."""
    return 1 if stack.size(1) == 1 or stack.stride(1) == 0 else stack.size(1)


def bias_table(bias: torch.Tensor) -> torch.Tensor:
    """LoRA bias ``[L, (1,) N]`` → ``[L, N]`` in the accumulation dtype."""
    return bias.reshape(bias.size(0), -1).to(accumulation_dtype(bias), copy=True).contiguous()


# -- the cache ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Signature:
    """Everything about a tensor that, when it changes, makes a prepared form stale."""

    version: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device


def _signature(tensor: torch.Tensor) -> _Signature | None:
    """``None`` for tensors without a version counter (inference tensors): those are never cached."""
    try:
        version = tensor._version
    except RuntimeError:
        return None
    return _Signature(
        version, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype, tensor.device
    )


@dataclass
class _Entry:
    ref: weakref.ReferenceType
    signature: _Signature
    prepared: torch.Tensor


class PreparedStacks:
    """Prepared (flattened, upcast) forms of weight stacks, made once per adapter set.

    ``get(stack, flat_a)`` returns the cached ``flat_a(stack)`` while ``stack`` is the same live tensor
    with the same version and layout, and recomputes it otherwise. One entry per (tensor, layout); an
    entry goes away with its tensor. ``hits`` / ``misses`` count lookups (the tests read them).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], _Entry] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, stack: torch.Tensor, layout: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        signature = _signature(stack)
        if signature is None:
            self.misses += 1
            return layout(stack)
        key = (id(stack), layout.__qualname__)
        entry = self._entries.get(key)
        # `entry.ref() is stack`: an id can be reused by a new tensor once the old one is freed.
        if entry is not None and entry.ref() is stack and entry.signature == signature:
            self.hits += 1
            return entry.prepared
        self.misses += 1
        prepared = layout(stack)
        self._entries[key] = _Entry(weakref.ref(stack, self._forget(key)), signature, prepared)
        return prepared

    def clear(self) -> None:
        self._entries.clear()

    def _forget(self, key: tuple[int, str]) -> Callable[[weakref.ReferenceType], None]:
        cache = weakref.ref(self)  # the callback must not keep the cache alive

        def forget(dead: weakref.ReferenceType) -> None:
            live = cache()
            if live is not None and key in live._entries and live._entries[key].ref is dead:
                del live._entries[key]

        return forget
