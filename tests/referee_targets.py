"""Targets that try to bend the referee, corrupt what they are handed, or do not repeat themselves.

Each wraps the correct ``hpu-emulated`` target (its numbers are right unless said otherwise) and
misbehaves in one way, as a backend or a vendor library it imports might:

* ``PatchesTorchAfterFirstCall``: correct, but after its first call it patches float64 matrix products
  in its process (as a library that swaps in its own kernels on first use): a referee in that process
  would compute a wrong oracle and blame a correct target;
* ``WrongAndPatchesFloat64``: wrong by 30 % on every add_lora_linear delta, and patches float64 products
  the same way, so that an in-process oracle would agree with it;
* ``PatchesTheHarness``: writes NaN into every output, after replacing the harness's judging and running
  functions in its process with ones that pass everything;
* ``WritesItsMetadata``: correct outputs, then overwrites the index tensors it was handed (bgmv
  ``lora_indices_tensor``, sgmv ``seq_len_tensor``, ``lora_shrink``'s ``token_lora_mapping`` and
  ``lora_ids``), which vLLM shares across every layer of a step;
* ``ForgetsItsBatchAfterOneCall``: a wrapper that drops its batch state after one call;
* ``WrongOneCallInTwelve``: wrong on one call in twelve, at random (a race, split-K atomics);
* ``LastBitWobbles``: correct, but one element differs by an ulp between calls (a reduction order that changes).
"""

from __future__ import annotations

import random

import torch

import conformance
from conformance.targets.hpu.targets import HpuEmulatedTarget


def _patch_float64_products(factor: float) -> None:
    """Every float64 ``matmul``/``@``/``einsum``/``bmm`` in this process, scaled by ``factor``."""
    if getattr(torch, "_patched_by_a_target", False):
        return
    torch._patched_by_a_target = True
    for module, name in ((torch, "matmul"), (torch, "bmm"), (torch, "einsum"), (torch.Tensor, "__matmul__"),
                         (torch.Tensor, "matmul")):
        original = getattr(module, name)

        def patched(*args, _original=original, **kwargs):
            result = _original(*args, **kwargs)
            return result * factor if isinstance(result, torch.Tensor) and result.dtype == torch.float64 else result

        setattr(module, name, patched)


class PatchesTorchAfterFirstCall(HpuEmulatedTarget):
    name = "patches-torch-after-first-call"

    def add_lora_linear(self, *args, **kwargs):
        result = super().add_lora_linear(*args, **kwargs)
        _patch_float64_products(1.5)
        return result


class WrongAndPatchesFloat64(HpuEmulatedTarget):
    name = "wrong-and-patches-float64"

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs):
        _patch_float64_products(1.3)
        return super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale * 1.3, output_slices, **kwargs)


class PatchesTheHarness(HpuEmulatedTarget):
    """Replaces every judging and running function it can find in its own process, then writes NaN."""

    name = "patches-the-harness"

    def __init__(self) -> None:
        super().__init__()
        import conformance.referee as referee
        import conformance.runner as runner
        import conformance.verdict.judge as judge_module
        from conformance.verdict import Outcome

        def always_pass(*args, **kwargs):
            from conformance.record import CaseResult

            case, case_id = args[0], args[1]
            return CaseResult(case_id, case, Outcome.PASS)

        for module, name in ((runner, "run_case"), (referee, "judge_op"), (runner, "judge_op"), (conformance.verdict, "judge"),
                             (judge_module, "judge")):
            setattr(module, name, always_pass)

    def add_lora_linear(self, y, *args, **kwargs):
        y.fill_(float("nan"))


class WritesItsMetadata(HpuEmulatedTarget):
    name = "writes-its-metadata"

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        super().bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        lora_indices_tensor.fill_(0)

    def sgmv_shrink(self, inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, *rest):
        super().sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, *rest)
        seq_len_tensor.add_(1)

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling):
        super().lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                            num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling)
        token_lora_mapping.fill_(-1)
        lora_ids.fill_(0)


class ForgetsItsBatchAfterOneCall(HpuEmulatedTarget):
    """After one wrapper call the batch is gone: later calls see every token without adapter."""

    name = "forgets-its-batch-after-one-call"

    def add_lora_linear(self, *args, **kwargs):
        result = super().add_lora_linear(*args, **kwargs)
        self._forget()
        return result

    def _forget(self) -> None:
        if getattr(self, "_mapping", None) is not None:
            from dataclasses import replace

            mapping = self._mapping
            super().update_metadata(replace(mapping, token_slots=(-1,) * len(mapping.token_slots),
                                            sampled_slots=(-1,) * len(mapping.sampled_slots)))

    def update_metadata(self, mapping):
        self._mapping = mapping
        return super().update_metadata(mapping)


class WrongOneCallInTwelve(HpuEmulatedTarget):
    """One add_lora_linear or bgmv_shrink call in twelve (at random, unseeded) adds its delta twice."""

    name = "wrong-one-call-in-twelve"
    _random = random.Random()  # seeded from the OS: the point is that it does not repeat

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs):
        if self._random.randrange(12) == 0:
            scale = scale * 2
        return super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if self._random.randrange(12) == 0:
            scaling = scaling * 2
        return super().bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)


class LastBitWobbles(HpuEmulatedTarget):
    """Correct, but every other add_lora_linear call ends one ulp higher in one element it writes, as a
    split-K reduction whose order changes from call to call does: nondeterministic, never wrong."""

    name = "last-bit-wobbles"

    def update_metadata(self, mapping):
        self._mapping, self._calls = mapping, 0
        return super().update_metadata(mapping)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs):
        result = super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)
        self._calls += 1
        rows = [row for row, slot in enumerate(self._mapping.token_slots) if slot != -1]
        if self._calls % 2 == 0 and rows:
            column = kwargs.get("offset_start", 0)
            y[rows[0], column] = torch.nextafter(y[rows[0], column], torch.tensor(float("inf"), dtype=y.dtype))
        return result
