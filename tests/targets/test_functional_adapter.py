"""Functional ops (they return their output's new value) adapted to the suite's in-place contract.

* ``output_arguments`` finds, from the op specs and the references' signatures, the argument each op
  writes: for every op it is exactly the one the golden reference writes;
* the adapter hands every tensor, also inside lists, through ``to_array``, and the result back through
  ``from_array``; it copies the returned value bit for bit, several outputs as a tuple in the spec's order;
* a returned None, a wrong shape (also one ``copy_`` would broadcast) or a wrong dtype (one ``copy_``
  would cast) is a clear error naming the op and the argument, and the case is broken, never passed;
* ``@functional_op`` on a name that is no op, or on a class that is not a ``FunctionalKernelTarget``, says so;
* the NumPy example (``examples/functional-lora-backend``, ``functional-example``) passes the smoke gate
  (in a subprocess, as a vendor runs it), and its kernels also carry the wrapper level through the
  classic composition and a functional wrapper method;
* a seeded fault in the example (the expand ignores ``offset_start``; the expand returns only the delta)
  fails the smoke cases it affects, which the correct example passes.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from example_backends import installed_example

from conformance.cases import Case
from conformance.cases.values import generator_for
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS, case_mapping
from conformance.runner import run_case
from conformance.targets import KERNEL_OPS, WRAPPER_OPS, FunctionalKernelTarget, known_targets, resolve
from conformance.targets.describe import probe_case
from conformance.targets.functional import FunctionalResultError, functional_op, output_arguments
from conformance.targets.kernel_target import KernelTarget
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "functional-lora-backend"
EXAMPLE_KERNELS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice",
                   "lora_shrink", "lora_expand")
LEFT_OUT = tuple(op for op in KERNEL_OPS + WRAPPER_OPS
                 if "routing" in OP_SPECS[op].knobs or "fp8_scales" in OP_SPECS[op].knobs)  # MoE and fp8: no NumPy kernels


@pytest.fixture(scope="module")
def example_class():
    """``FunctionalExampleTarget``, or a failure saying how to install the example."""
    return installed_example("functional_lora_backend", "FunctionalExampleTarget", "functional-lora-backend")


@pytest.fixture(scope="module")
def smoke_cases() -> list[tuple[str, Case]]:
    return profile_cases("smoke")


def cheapest(smoke_cases, op: str, count: int, where=lambda case: True) -> list[tuple[str, Case]]:
    """The ``count`` cheapest smoke cases of ``op`` (float16 and float32: what the example claims) meeting ``where``."""
    chosen = [(case_id, case) for case_id, case in smoke_cases
              if case.op == op and case.dtype in ("float16", "float32") and where(case)]
    return sorted(chosen, key=lambda pair: pair[1].cost)[:count]


def small_bgmv_shrink_arguments() -> tuple:
    """``bgmv_shrink``'s arguments for two tokens (slot 0, then none), rank 4, 8 features."""
    x, lora_a = torch.randn(2, 8), torch.randn(1, 4, 8)
    return x, lora_a, torch.zeros(2, 4), torch.tensor([0, -1]), 1.0


# -- where the output is ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(OP_SPECS))
def test_the_output_argument_found_from_the_spec_is_the_one_the_reference_writes(op):
    spec = OP_SPECS[op]
    case = probe_case(op, "float32")
    values = spec.make_values(case, generator_for(case))
    call = spec.make_call(case, values, torch.device("cpu"))
    before = [arg.clone() if isinstance(arg, torch.Tensor) else None for arg in call.args]
    reference = ReferenceTarget()
    reference.update_metadata(case_mapping(case))
    getattr(reference, op)(*call.args, **call.kwargs)
    written = {i for i, arg in enumerate(call.args) if before[i] is not None and not torch.equal(before[i], arg)}
    assert {argument.position for argument in output_arguments(op)} == written
    assert len(output_arguments(op)) == len(spec.outputs)


def test_outputs_are_named_by_the_references_parameters():
    assert [a.name for a in output_arguments("bgmv_shrink")] == ["output_tensor"]
    assert [a.name for a in output_arguments("add_lora_linear")] == ["y"]
    # the spec's value is expert_ids; vLLM's parameter, which a functional op receives, is experts_ids
    assert [a.name for a in output_arguments("moe_lora_align_block_size")] == [
        "sorted_token_ids", "experts_ids", "num_tokens_post_pad"]


# -- the hooks and the copy --------------------------------------------------------------------------


class Boxed:
    """A foreign array: a torch tensor the op may only reach through ``.tensor``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class BoxedShrink(FunctionalKernelTarget):
    """``lora_shrink`` over boxed arrays, noting the type of every argument it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple] = []

    def to_array(self, tensor):
        return Boxed(tensor)

    def from_array(self, array, like):
        return array.tensor.to(like.device)

    @functional_op
    def lora_shrink(self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling):
        self.received.append((inputs, lora_a_weights, output_tensor, no_lora_flag_cpu, scaling))
        new = output_tensor.tensor.clone()
        slots = token_lora_mapping.tensor.long()
        rows = slots != -1
        for s, lora_a in enumerate(lora_a_weights):
            per_row = lora_a.tensor[slots[rows]].float()  # [rows, R, H]: each row's LoRA-A
            new[s, rows, : per_row.size(1)] += scaling * torch.einsum("th,trh->tr", inputs.tensor[rows].float(), per_row)
        return Boxed(new)


def test_the_hooks_convert_every_tensor_also_inside_lists_and_the_result_back(smoke_cases):
    [(case_id, case)] = cheapest(smoke_cases, "lora_shrink", 1, lambda case: case.num_slices > 1 and not case.weights_4d)
    target = BoxedShrink()
    assert run_case(target, case, case_id).outcome is Outcome.PASS
    inputs, stacks, output, flag, scaling = target.received[0]
    assert isinstance(inputs, Boxed) and isinstance(output, Boxed) and isinstance(flag, Boxed)
    assert isinstance(stacks, list) and len(stacks) == case.num_slices and all(isinstance(a, Boxed) for a in stacks)
    assert isinstance(scaling, float)  # scalars pass through


def test_the_returned_value_is_copied_bit_for_bit_into_the_output_argument():
    class ReturnsMarkers(FunctionalKernelTarget):
        @functional_op
        def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
            return torch.arange(output_tensor.numel(), dtype=output_tensor.dtype).view(output_tensor.shape)

    x, lora_a, out, slots, scale = small_bgmv_shrink_arguments()
    ReturnsMarkers().bgmv_shrink(x, lora_a, out, slots, scale)
    assert torch.equal(out, torch.arange(8, dtype=torch.float32).view(2, 4))  # the row of slot −1 too: it is judged


def test_several_outputs_are_returned_as_a_tuple_in_the_specs_order(smoke_cases):
    align_reference = OP_SPECS["moe_lora_align_block_size"].reference

    class FunctionalAlign(FunctionalKernelTarget):
        @functional_op
        def moe_lora_align_block_size(self, *args):
            args = [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]
            align_reference(*args)  # the golden reference writes them in place; return the three it wrote
            return args[7], args[8], args[9]

    class ReturnsOne(FunctionalKernelTarget):
        @functional_op
        def moe_lora_align_block_size(self, *args):
            return args[7]

    [(case_id, case)] = cheapest(smoke_cases, "moe_lora_align_block_size", 1)
    assert run_case(FunctionalAlign(), case, case_id).outcome is Outcome.PASS
    result = run_case(ReturnsOne(), case, case_id)
    assert result.outcome is Outcome.BROKEN
    assert ("return a tuple of the new values of its 3 outputs, in this order: sorted_token_ids, experts_ids, "
            "num_tokens_post_pad") in result.message


# -- what is not the new value of the output -----------------------------------------------------------


def returning(make_result):
    """A functional target whose ``bgmv_shrink`` returns ``make_result(the correct new output)``."""
    class Target(FunctionalKernelTarget):
        name = "returns-the-wrong-thing"

        @functional_op
        def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
            new = output_tensor.clone()
            OP_SPECS["bgmv_shrink"].reference(inputs, lora_a_weights, new, lora_indices_tensor, scaling)
            return make_result(new)

    return Target


WRONG_RESULTS = {
    "None": (lambda new: None, "functional op bgmv_shrink returned None; return the new value of output_tensor"),
    "one row, which copy_ would broadcast": (
        lambda new: new[:1], "returned output_tensor of shape (1, {r}) and dtype torch.float32; expected shape ({t}, {r})"),
    "float64, which copy_ would round": (
        lambda new: new.double(), "returned output_tensor of shape ({t}, {r}) and dtype torch.float64; expected shape "
                                  "({t}, {r}) and dtype torch.float32"),
}


@pytest.mark.parametrize("wrong", list(WRONG_RESULTS))
def test_a_result_that_is_not_the_new_output_is_a_clear_error_and_the_case_is_broken(smoke_cases, wrong):
    make_result, message = WRONG_RESULTS[wrong]
    target = returning(make_result)()
    x, lora_a, out, slots, scale = small_bgmv_shrink_arguments()
    with pytest.raises(FunctionalResultError, match=re.escape(message.format(t=2, r=4))):
        target.bgmv_shrink(x, lora_a, out, slots, scale)
    assert torch.equal(out, torch.zeros(2, 4))  # nothing copied

    [(case_id, case)] = cheapest(smoke_cases, "bgmv_shrink", 1, lambda case: case.dtype == "float32")
    result = run_case(target, case, case_id)
    assert result.outcome is Outcome.BROKEN, result.message
    assert message.format(t=case.num_tokens, r=case.max_rank) in result.message
    assert run_case(returning(lambda new: new)(), case, case_id).outcome is Outcome.PASS  # the same target, right


def test_functional_op_names_an_op_and_needs_a_functional_target():
    with pytest.raises(TypeError, match="bgmv_shrunk is not an op of the suite"):
        type("Misnamed", (FunctionalKernelTarget,), {"bgmv_shrunk": functional_op(lambda self, *args: None)})

    class NotFunctional(KernelTarget):
        @functional_op
        def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
            return output_tensor

    with pytest.raises(TypeError, match="not a FunctionalKernelTarget"):
        NotFunctional().bgmv_shrink(*small_bgmv_shrink_arguments())


# -- the NumPy example ---------------------------------------------------------------------------------


def test_the_example_is_registered_and_defines_the_dense_kernels_functionally(example_class):
    assert importlib.metadata.distribution("functional-lora-backend").version
    assert known_targets()["functional-example"] == "functional_lora_backend.target:FunctionalExampleTarget"
    assert resolve("functional-example") is example_class
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert sorted(project["dependencies"]) == ["lora-conformance", "numpy", "torch"]
    target = example_class()
    assert target.functional_ops() == target.kernel_ops() == EXAMPLE_KERNELS
    assert set(target.implemented_ops()) == set(KERNEL_OPS + WRAPPER_OPS) - set(LEFT_OUT)
    source = "\n".join(path.read_text() for path in (EXAMPLE / "functional_lora_backend").glob("*.py"))
    assert "conformance.reference" not in source and "from conformance import reference" not in source


def test_the_example_hands_its_kernels_read_only_numpy_arrays(example_class):
    target = example_class()
    array = target.to_array(torch.ones(2, 3, dtype=torch.float16))
    assert isinstance(array, np.ndarray) and array.dtype == np.float16 and not array.flags.writeable
    with pytest.raises(TypeError, match="NumPy has no bfloat16"):
        target.to_array(torch.ones(2, dtype=torch.bfloat16))


@pytest.mark.integration  # the example backend's whole smoke run
def test_the_example_passes_the_smoke_gate(example_class, tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--target=functional-example",
         "--profile=smoke", "--report-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    counts = report["gate"]["counts"]
    assert report["gate"]["passed"] and counts["fail"] == counts["broken"] == 0, counts
    op_results = [r for r in report["results"] if r["level"] not in ("model", "layer")]
    assert {r["outcome"] for r in op_results if r["op"] in LEFT_OUT or r["dtype"] == "bfloat16"} == {"not supported"}
    assert {r["outcome"] for r in op_results if r["op"] not in LEFT_OUT and r["dtype"] != "bfloat16"} == {"pass"}


def test_the_example_kernels_carry_the_wrapper_level_through_the_classic_composition(example_class, smoke_cases):
    classic = type("FunctionalExampleClassic", (example_class,), {"wrapper_paths": ("classic",)})()
    chosen = [pair for op in ("add_lora_linear", "add_lora_logits", "add_lora_embedding")
              for pair in cheapest(smoke_cases, op, 2)]
    assert {run_case(classic, case, case_id).outcome for case_id, case in chosen} == {Outcome.PASS}


def test_a_wrapper_method_may_be_functional_too(example_class, smoke_cases):
    from functional_lora_backend import kernels

    class FunctionalEmbedding(example_class):
        @functional_op
        def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
            rows = y.reshape(-1, y.shape[-1])
            new = kernels.expand(x, kernels.as_3d(lora_b_stacked), rows, self.token_indices.numpy(), 0, add_inputs)
            return new.reshape(y.shape)

    target = FunctionalEmbedding()
    assert target.overrides("add_lora_embedding") and target.derived_from("add_lora_embedding") == ()
    for case_id, case in cheapest(smoke_cases, "add_lora_embedding", 3):
        assert run_case(target, case, case_id).outcome is Outcome.PASS, case_id


# -- seeded faults in the example, caught --------------------------------------------------------------


def seeded_faults(example_class) -> dict[str, tuple]:
    """Per fault: the example with it, the op it breaks, which smoke cases of that op it must fail and which
    it must still pass."""

    class IgnoresOffsetStart(example_class):
        @functional_op
        def lora_expand(self, *args):
            *head, offset_start, add_inputs = args  # the suite passes all eleven arguments positionally
            return example_class.lora_expand.functional(self, *head, 0, add_inputs)

    class ReturnsOnlyTheDelta(example_class):
        @functional_op
        def bgmv_expand(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
            zeros = np.zeros_like(output_tensor)  # the glue's mistake: the delta alone, not the new output
            return example_class.bgmv_expand.functional(self, inputs, lora_b_weights, zeros, lora_indices_tensor,
                                                        add_inputs)

    def overwrites_every_row(case: Case) -> bool:  # the delta alone is then right
        return not case.add_inputs and -1 not in case.token_slots

    return {
        "ignores offset_start": (IgnoresOffsetStart, "lora_expand", lambda case: case.offset_start > 0,
                                 lambda case: case.offset_start == 0),
        "returns only the delta": (ReturnsOnlyTheDelta, "bgmv_expand", lambda case: case.add_inputs, overwrites_every_row),
    }


@pytest.mark.parametrize("fault", ["ignores offset_start", "returns only the delta"])
def test_a_seeded_fault_in_the_example_fails_the_cases_it_affects(example_class, smoke_cases, fault):
    faulty, op, affected, unaffected = seeded_faults(example_class)[fault]
    assert getattr(faulty, op) is not getattr(example_class, op)  # the fault is the subclass's alone
    chosen = cheapest(smoke_cases, op, 2, affected)
    assert len(chosen) == 2
    for case_id, case in chosen:
        assert run_case(example_class(), case, case_id).outcome is Outcome.PASS, case_id
        result = run_case(faulty(), case, case_id)
        assert result.outcome is Outcome.FAIL, (case_id, result.outcome, result.message)
    # and nothing else: a case of the op the fault does not reach still passes
    [(case_id, case)] = cheapest(smoke_cases, op, 1, unaffected)
    assert run_case(faulty(), case, case_id).outcome is Outcome.PASS, case_id
