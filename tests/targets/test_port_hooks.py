"""The hooks a port of a backend not shaped like vLLM uses (docs/ports.md), each held to its contract.

* ``Target.call_context(op)`` is entered around ``update_metadata`` and around every call of the op (its
  ``synchronize`` included), afresh per call, and left before the outputs are read;
* ``VllmPunicaWrapperTarget.can_update_inplace``: False takes a result method's returned tensor as the new
  ``y`` (checked, copied, whether or not ``y`` was written), True drops it as vLLM's layers do; a return that
  is not the new ``y`` is a ``WrapperResultError`` naming the method, and the case is broken;
* ``adapt``: a kernel of another signature called through its declared mapping (by keyword, by position,
  computed arguments, defaults of the op filled in); a declaration that does not fit the op's spec is a
  ``KernelAdapterError`` naming what, when the class is made or in ``check_available``; a returned output
  is checked as a functional op's.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from conformance.cases.values import generator_for
from conformance.ops import OP_SPECS
from conformance.runner import run_case
from conformance.target_call import answer, call_target, handed_tensors
from conformance.targets import vllm_wrapper
from conformance.targets.describe import probe_case
from conformance.targets.functional import FunctionalResultError
from conformance.targets.kernel_adapter import KernelAdapterError, adapt
from conformance.targets.kernel_target import KernelTarget
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome
from conformance.wire import to_data

REFERENCE_SHRINK = OP_SPECS["bgmv_shrink"].reference


def probe(op: str):
    case = probe_case(op, "float32")
    return case, OP_SPECS[op].make_values(case, generator_for(case))


# -- call_context -------------------------------------------------------------------------------------


class RecordsContext(ReferenceTarget):
    """The golden reference, noting when its context is entered and left and what runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    @contextlib.contextmanager
    def call_context(self, op):
        self.events.append(f"enter {op}")
        yield
        self.events.append(f"exit {op}")

    def update_metadata(self, mapping) -> None:
        self.events.append("update_metadata")
        super().update_metadata(mapping)

    def add_lora_linear(self, *args, **kwargs) -> None:
        self.events.append("add_lora_linear")
        super().add_lora_linear(*args, **kwargs)

    def synchronize(self) -> None:
        self.events.append("synchronize")


def test_the_call_context_is_entered_around_update_metadata_and_each_call_with_its_wait():
    case, values = probe("add_lora_linear")
    target = RecordsContext()
    assert call_target(target, case, values, runs=2).status == "ran"
    per_call = ["enter add_lora_linear", "add_lora_linear", "synchronize", "exit add_lora_linear"]
    assert target.events == ["enter update_metadata", "update_metadata", "exit update_metadata", *per_call, *per_call]


def test_the_default_call_context_is_a_null_context_on_every_target_kind():
    for target in (ReferenceTarget(), KernelTarget()):
        with target.call_context("bgmv_shrink") as entered:
            assert entered is None


# -- can_update_inplace ---------------------------------------------------------------------------------

# Imported at collection: the vLLM modules the target imports (its LoRAConfig, its LoRAMapping) run `file` through
# cpuinfo when first imported, a process a unit test may not start (tests/conftest.py).
try:
    import vllm.config.lora
    import vllm.lora.layers  # noqa: F401
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
except ImportError:
    PunicaWrapperCPU = None


@pytest.fixture(scope="module")
def punica_cpu() -> type:
    """vLLM's ``PunicaWrapperCPU``; the tests of the wrapper route skip, saying why, where vLLM is not installed."""
    if PunicaWrapperCPU is None:
        pytest.skip("needs vLLM (pip install 'lora-conformance[vllm]')")
    return PunicaWrapperCPU


def returning_wrapper(punica_cpu: type, make_result):
    """A ``PunicaWrapperCPU`` whose ``add_lora_embedding`` leaves ``y`` alone and returns ``make_result(new y)``."""

    class Returning(punica_cpu):
        def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
            new = y.clone()
            reference = ReferenceTarget()
            reference.update_metadata(self.suite_mapping)
            reference.add_lora_embedding(new, x, lora_b_stacked, add_inputs)
            return make_result(new)

    return Returning


def wrapper_target(punica_cpu: type, make_result, inplace: bool):
    class Target(vllm_wrapper.VllmPunicaWrapperTarget):
        name = "returns-y"
        wrapper_class = returning_wrapper(punica_cpu, make_result)
        can_update_inplace = inplace

        def update_metadata(self, mapping) -> None:
            super().update_metadata(mapping)
            self.wrapper.suite_mapping = mapping  # the stand-in computes with the suite's reference

    Target.check_available()
    return Target()


@pytest.fixture(scope="module")
def embedding_case():
    """A float32 add_lora_embedding case where some row has an adapter (so a dropped result is wrong)."""
    case, values = probe("add_lora_embedding")
    assert any(slot != -1 for slot in case.token_slots)
    return case, values


def test_a_returned_y_is_the_result_where_the_platform_cannot_update_in_place(punica_cpu, embedding_case):
    case, values = embedding_case
    returned = run_case(wrapper_target(punica_cpu, lambda new: new, inplace=False), case, "returned")
    assert returned.outcome is Outcome.PASS, returned.message
    dropped = run_case(wrapper_target(punica_cpu, lambda new: new, inplace=True), case, "dropped")
    assert dropped.outcome is Outcome.FAIL, dropped.message  # vLLM's layers drop it on an in-place platform


WRONG_RETURNS = {
    "None": (lambda new: None, "add_lora_embedding returned None, not the new y"),
    "a row": (lambda new: new[:1], "add_lora_embedding returned a tensor of shape (1, {w}) and dtype torch.float32; "
                                   "expected y's shape ({t}, {w})"),
    "float64": (lambda new: new.double(), "and dtype torch.float64; expected y's shape ({t}, {w}) and dtype torch.float32"),
}


@pytest.mark.parametrize("wrong", list(WRONG_RETURNS))
def test_a_return_that_is_not_the_new_y_is_a_clear_error_and_the_case_is_broken(punica_cpu, embedding_case, wrong):
    case, values = embedding_case
    make_result, message = WRONG_RETURNS[wrong]
    result = run_case(wrapper_target(punica_cpu, make_result, inplace=False), case, "wrong")
    assert result.outcome is Outcome.BROKEN, result.message
    assert message.format(t=case.num_tokens, w=values["out"].size(-1)) in result.message
    assert "WrapperResultError" in result.message


def test_only_the_methods_whose_result_vllm_takes_are_copied():
    assert vllm_wrapper.RESULT_METHODS == {"add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding",
                                           "add_lora_logits"}
    assert vllm_wrapper.VllmPunicaWrapperTarget.can_update_inplace is True  # vLLM's Platform default


# -- adapt ---------------------------------------------------------------------------------------------


def my_shrink(out, x, w, rows, scale):
    """bgmv_shrink's math in another argument order."""
    REFERENCE_SHRINK(x, w, out, rows, scale)


def test_an_adapted_kernel_is_called_through_its_declared_mapping():
    seen = {}

    def by_keyword(x, out, rows, scale, extra):
        seen.update(scale=scale, extra=extra)
        REFERENCE_SHRINK(x, seen["w"], out, rows, scale)

    class Keyword(KernelTarget):
        bgmv_shrink = adapt(by_keyword, {"x": "inputs", "out": "output_tensor", "rows": "lora_indices_tensor",
                                         "scale": "scaling", "extra": lambda a: a["lora_a_weights"].shape})

    class Positional(KernelTarget):
        bgmv_shrink = adapt(my_shrink, ["output_tensor", "inputs", "lora_a_weights", "lora_indices_tensor", "scaling"])

    x, w, rows = torch.randn(3, 8), torch.randn(2, 4, 8), torch.tensor([1, -1, 0])
    seen["w"] = w
    expected = torch.zeros(3, 4)
    REFERENCE_SHRINK(x, w, expected, rows, 1.0)
    out = torch.zeros(3, 4)
    Keyword().bgmv_shrink(x, w, out, rows)  # scaling left out: the op's default, 1.0
    assert torch.equal(out, expected) and seen == {"w": w, "scale": 1.0, "extra": (2, 4, 8)}
    out = torch.zeros(3, 4)
    Positional().bgmv_shrink(x, w, out, rows, 1.0)
    assert torch.equal(out, expected)
    assert Positional().kernel_ops() == ("bgmv_shrink",)


def test_a_kernel_that_returns_its_output_is_checked_and_copied():
    def returns_new(x, w, rows, current):
        new = current.clone()
        REFERENCE_SHRINK(x, w, new, rows, 1.0)
        return new

    class Returns(KernelTarget):
        bgmv_shrink = adapt(returns_new, ["inputs", "lora_a_weights", "lora_indices_tensor", "output_tensor"], returns="output")

    class ReturnsARow(KernelTarget):
        bgmv_shrink = adapt(lambda current: current[:1], ["output_tensor"], returns="output")

    x, w, rows = torch.randn(3, 8), torch.randn(2, 4, 8), torch.tensor([1, -1, 0])
    expected, out = torch.zeros(3, 4), torch.zeros(3, 4)
    REFERENCE_SHRINK(x, w, expected, rows, 1.0)
    Returns().bgmv_shrink(x, w, out, rows, 1.0)
    assert torch.equal(out, expected)
    with pytest.raises(FunctionalResultError, match=re.escape("returned output_tensor of shape (1, 4)")):
        ReturnsARow().bgmv_shrink(x, w, torch.zeros(3, 4), rows, 1.0)


MISFITS = {
    "not a kernel op": ("add_lora_linear", my_shrink, ["output_tensor"], {},
                        "adapt(my_shrink) for add_lora_linear: add_lora_linear is not a kernel op of the suite"),
    "no such parameter": ("bgmv_shrink", my_shrink, ["output_tensor", "inputs", "lora_a_weights", "lora_indices_tensor", "scale"], {},
                          "'scale' is no parameter of bgmv_shrink; its parameters are inputs, lora_a_weights, output_tensor, "
                          "lora_indices_tensor, scaling"),
    "the kernel does not take it": ("bgmv_shrink", my_shrink, {"out": "output_tensor", "input": "inputs"}, {},
                                    "my_shrink(out, x, w, rows, scale) does not take the declared arguments"),
    "never handed its output": ("bgmv_shrink", my_shrink, ["inputs", "inputs", "lora_a_weights", "lora_indices_tensor", "scaling"], {},
                                "is never handed output_tensor; pass it, or declare returns='output'"),
    "an unknown result": ("bgmv_shrink", my_shrink, ["output_tensor"], {"returns": "delta"},
                          "returns='delta'; it is one of nothing, output"),
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_a_declaration_that_does_not_fit_the_op_is_refused_when_the_class_is_made(misfit):
    op, function, arguments, options, message = MISFITS[misfit]
    with pytest.raises(KernelAdapterError, match=re.escape(message)):
        type("Misfit", (KernelTarget,), {op: adapt(function, arguments, **options)})


def test_an_adapter_in_kernel_ops_is_checked_when_the_target_checks_it_can_run(punica_cpu):
    class Declared(vllm_wrapper.VllmPunicaWrapperTarget):
        name = "adapted-kernel-ops"
        wrapper_class = punica_cpu
        kernel_ops = {"bgmv_shrink": adapt(my_shrink, ["output_tensor", "inputs", "lora_a_weights", "lora_indices_tensor",
                                                       "scaling"])}

    Declared.check_available()
    case, values = probe("bgmv_shrink")
    assert run_case(Declared(), case, "adapted").outcome is Outcome.PASS

    class Misdeclared(vllm_wrapper.VllmPunicaWrapperTarget):
        name = "misadapted-kernel-ops"
        wrapper_class = punica_cpu
        kernel_ops = {"bgmv_shrink": adapt(my_shrink, ["out"])}

    with pytest.raises(KernelAdapterError, match="'out' is no parameter of bgmv_shrink"):
        Misdeclared.check_available()


def test_a_raise_in_update_metadata_is_an_answer_the_referee_reads():
    class Raises(ReferenceTarget):
        def update_metadata(self, mapping) -> None:
            raise RuntimeError("no metadata for this batch")

    case, values = probe("add_lora_linear")
    outcome = call_target(Raises(), case, values, runs=2)
    read = answer(to_data(outcome), handed_tensors(OP_SPECS[case.op], case, values), 2)  # not refused as malformed
    assert read.status == "raised" and read.raised_in == 0 and "no metadata for this batch" in read.message
