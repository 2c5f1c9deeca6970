"""The cache of prepared (flattened, upcast) weight stacks: made once per adapter set, never stale.

Keyed by the stack's identity and version (plus shape, strides, offset, dtype, device), never by
``data_ptr`` alone: vLLM bug #50820 was a pointer-keyed cache serving stale entries.
"""

from __future__ import annotations

import torch

from conformance.reference import LoRAMapping, PunicaWrapperReference
from conformance.targets.hpu import HpuPunicaWrapper, LoRAEngine
from conformance.targets.hpu.stacks import PreparedStacks, flat_a, flat_b

L, R, H, N = 3, 4, 16, 12
SLOTS = (0, 2, -1, 1, 2)


def mapping() -> LoRAMapping:
    return LoRAMapping(SLOTS, SLOTS, (len(SLOTS),), False, L)


def reference_linear(y, x, a, b) -> torch.Tensor:
    reference = PunicaWrapperReference()
    reference.update_metadata(mapping())
    y = y.clone()
    reference.add_lora_linear(y, x, (a,), (b,), 1.0, (N,))
    return y


def hpu_linear(wrapper, y, x, a, b) -> torch.Tensor:
    y = y.clone()
    wrapper.add_lora_linear(y, x, (a,), (b,), 1.0, (N,))
    return y


def test_prepared_once_per_adapter_set_and_reused():
    cache = PreparedStacks()
    a = torch.randn(L, 1, R, H)
    first = cache.get(a, flat_a)
    assert cache.get(a, flat_a) is first
    assert (cache.hits, cache.misses) == (1, 1)
    assert torch.equal(first, a.squeeze(1).reshape(L * R, H))
    assert cache.get(a, flat_b) is not first  # one entry per layout


def test_an_in_place_adapter_load_invalidates_the_entry():
    """vLLM's set_lora writes into a view of the stack; the version counter is shared with views."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(L, 1, R, H, generator=gen), torch.randn(L, 1, N, R, generator=gen)
    x, y = torch.randn(len(SLOTS), H, generator=gen), torch.randn(len(SLOTS), N, generator=gen)
    wrapper = HpuPunicaWrapper(LoRAEngine())
    wrapper.update_metadata(mapping())
    torch.testing.assert_close(hpu_linear(wrapper, y, x, a, b), reference_linear(y, x, a, b))

    a[2, 0, :2].copy_(torch.randn(2, H, generator=gen))  # load a new rank-2 adapter into slot 2
    b[2, 0].zero_()
    b[2, 0, :, :2] = torch.randn(N, 2, generator=gen)
    torch.testing.assert_close(hpu_linear(wrapper, y, x, a, b), reference_linear(y, x, a, b))


def test_same_data_ptr_different_tensor_never_hits():
    """Two views of one storage start at the same address but are different stacks."""
    cache = PreparedStacks()
    storage = torch.randn(2 * L * R * H)
    as_stack = storage[: L * R * H].view(L, R, H)
    other_view = storage.view(2 * L, R, H)  # same data_ptr, other shape
    same_shape_view = storage[: L * R * H].view(L, R, H)  # same data_ptr, shape and version counter
    assert as_stack.data_ptr() == other_view.data_ptr() == same_shape_view.data_ptr()
    first = cache.get(as_stack, flat_a)
    assert cache.get(other_view, flat_a).shape == (2 * L * R, H)
    assert cache.get(same_shape_view, flat_a) is not first
    assert cache.misses == 3 and cache.hits == 0


def test_a_freed_stack_leaves_the_cache_and_its_address_cannot_alias():
    gen = torch.Generator().manual_seed(1)
    wrapper = HpuPunicaWrapper(LoRAEngine())
    wrapper.update_metadata(mapping())
    x, y = torch.randn(len(SLOTS), H, generator=gen), torch.randn(len(SLOTS), N, generator=gen)
    for _ in range(5):  # new adapters in freshly allocated stacks, often at a recycled address
        a, b = torch.randn(L, 1, R, H, generator=gen), torch.randn(L, 1, N, R, generator=gen)
        torch.testing.assert_close(hpu_linear(wrapper, y, x, a, b), reference_linear(y, x, a, b))
        del a, b  # tensors are freed by reference counting: no gc pass needed
    assert len(wrapper.engine.stacks) == 0, "entries of freed stacks must go away with them"


def test_reusing_a_stack_at_another_offset_writes_the_new_columns():
    """The scenario of vLLM #50820: the same LoRA-B stack expanded at offset 0, then at offset 7."""
    gen = torch.Generator().manual_seed(2)
    b = torch.randn(L, 1, N, R, generator=gen)
    s = torch.randn(1, len(SLOTS), R, generator=gen)
    wrapper, reference = HpuPunicaWrapper(LoRAEngine()), PunicaWrapperReference()
    wrapper.update_metadata(mapping())
    reference.update_metadata(mapping())
    for offset in (0, 7, 0):
        y = torch.randn(len(SLOTS), N + 7, generator=gen)
        got, want = y.clone(), y.clone()
        wrapper.add_expand(got, s, (b,), (N,), offset, True)
        reference.add_expand(want, s, (b,), (N,), offset, True)
        torch.testing.assert_close(got, want)


def test_inference_tensors_are_prepared_every_call_and_stay_correct():
    with torch.inference_mode():
        a = torch.randn(L, 1, R, H)
    cache = PreparedStacks()
    cache.get(a, flat_a)
    cache.get(a, flat_a)
    assert (cache.hits, cache.misses, len(cache)) == (0, 2, 0)
