"""Judging an installed vLLM ``PunicaWrapper`` subclass: ``VllmPunicaWrapperTarget`` and its example.

* the example backend (``examples/vllm-wrapper-backend``: a ``PunicaWrapperCPU`` subclass fixing vLLM
  0.32's CPU deviations) is registered as ``vllm-wrapper-example`` and passes the smoke gate, run as a
  vendor runs it; the subprocess runs two ops' cases (about 130: 50 s on two busy shared cores; the whole
  smoke profile, 1,295 cases, took 2 min 45 s and passes too: 436 pass, 859 not supported, no failure);
* a seeded fault in the example's wrapper is caught on a few cheap cases, in-process, where the
  example itself passes them;
* a method the wrapper class leaves abstract, or inherits as PunicaWrapperBase's ``raise
  NotImplementedError``, is an op "not implemented" with that reason, in the facts and in the case;
* a ``wrapper_class`` (or ``kernel_ops``) that does not resolve is a one-line TargetUnavailable naming why;
* the wrapper is built and fed as vLLM's model manager does; arguments reach it by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from example_backends import installed_example

pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu", reason="needs vLLM (pip install 'lora-conformance[vllm]')")

from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from conformance.generator.profiles import profile_cases
from conformance.runner import run_case
from conformance.targets import TargetUnavailable, known_targets, resolve
from conformance.targets._vllm import vllm_version
from conformance.targets.facts import facts_of
from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget
from conformance.verdict import Outcome

ROOT = Path(__file__).resolve().parents[2]
# the wrapper methods FixedPunicaWrapperCPU implements (PunicaWrapperCPU has no MoE LoRA)
WRAPPER_METHODS = ("add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding", "add_lora_logits",
                   "apply_lora_full_linear", "token_classification_head")


@pytest.fixture(scope="module")
def example_class():
    return installed_example("vllm_wrapper_backend", "VllmWrapperExampleTarget", "vllm-wrapper-backend")


@pytest.fixture(scope="module")
def fixed_wrapper_class(example_class):
    example_class.check_available()
    return example_class.wrapper_class


@pytest.fixture(scope="module")
def smoke_cases():
    return profile_cases("smoke")


def cheapest(smoke_cases, op: str, count: int, where=lambda case: True):
    """The ``count`` cheapest smoke cases of ``op`` that satisfy ``where``."""
    cases = [(i, c) for i, c in smoke_cases if c.op == op and where(c)]
    cases.sort(key=lambda pair: pair[1].num_tokens * pair[1].hidden_size * pair[1].max_rank * pair[1].num_slices)
    assert len(cases) >= count, (op, len(cases))
    return cases[:count]


def target_over(wrapper_class, **attributes) -> VllmPunicaWrapperTarget:
    """A target judging ``wrapper_class``, as a vendor subclass declares one."""
    cls = type("JudgedWrapper", (VllmPunicaWrapperTarget,), {"name": "judged-wrapper", "wrapper_class": wrapper_class, **attributes})
    return cls()


# -- the example: installed, registered, passes the gate ----------------------------------------------


def test_the_example_is_registered_and_states_the_vllm_it_runs_on(example_class, fixed_wrapper_class):
    assert known_targets()["vllm-wrapper-example"] == "vllm_wrapper_backend.target:VllmWrapperExampleTarget"
    assert resolve("vllm-wrapper-example") is example_class
    assert issubclass(fixed_wrapper_class, PunicaWrapperCPU)  # the dotted name, imported by check_available
    facts = facts_of(example_class)
    assert facts.package_versions == {"vllm": vllm_version()}
    assert {"add_shrink", "add_lora_linear", "apply_lora_full_linear", "token_classification_head"} <= set(facts.methods)
    assert "add_lora_w13" not in facts.methods and "PunicaWrapperBase.add_lora_w13" in facts.why_not_implemented["add_lora_w13"]


@pytest.mark.integration  # the example backend's whole smoke run, as a vendor runs it (about 3 minutes on 2 busy cores)
def test_the_example_passes_the_smoke_gate(example_class, tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--target=vllm-wrapper-example",
         "--profile=smoke", "--report-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    counts = report["gate"]["counts"]
    assert report["gate"]["passed"] and counts["fail"] == counts["broken"] == counts["known failure"] == 0, counts
    results = report["results"]
    forwarded = [r for r in results if r["op"] in WRAPPER_METHODS]  # what the wrapper class implements
    assert {r["op"] for r in forwarded if r["outcome"] == "pass"} == set(WRAPPER_METHODS)
    # what vLLM 0.32's own PunicaWrapperCPU gets wrong (the cpu target's expectations) passes here
    claimed = [r for r in forwarded if "bias" not in r["features"]]
    assert {r["outcome"] for r in claimed if "no_add_inputs" in r["features"]} == {"pass"}
    assert {r["outcome"] for r in claimed if {"neg1", "allneg1"} & set(r["features"])} == {"pass"}
    # of those, all it declines is LoRA bias, which vLLM 0.32's wrapper API does not carry
    assert all("no lora_bias_stacked" in r["message"] for r in forwarded if r["outcome"] == "not supported")
    # every other op case is not supported, each with the reason the target states (kernels, MoE)
    others = [r for r in results if r["level"] in ("kernel", "wrapper") and r["op"] not in WRAPPER_METHODS]
    assert others and {r["outcome"] for r in others} == {"not supported"}


# -- a seeded fault in the wrapper is caught -------------------------------------------------------


def offset_ignored(fixed):
    class OffsetIgnored(fixed):
        def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
            super().add_expand(y, x, lora_b_stacked, output_slices, 0, add_inputs, **kwargs)

    return OffsetIgnored


def scaled_twice(fixed):
    class ScaledTwice(fixed):
        def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
            super().add_shrink(y, x, lora_a_stacked, scale * scale, **kwargs)

    return ScaledTwice


@pytest.mark.parametrize(("fault", "op", "where"), [
    (offset_ignored, "add_expand", lambda case: case.offset_start > 0 and not case.bias),
    (scaled_twice, "add_lora_linear", lambda case: case.scale not in (1.0, -1.0) and not case.bias),
])
@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_a_seeded_fault_in_the_wrapper_is_caught(fixed_wrapper_class, smoke_cases, fault, op, where):
    cases = cheapest(smoke_cases, op, 3, where)
    correct, faulty = target_over(fixed_wrapper_class), target_over(fault(fixed_wrapper_class))
    assert [run_case(correct, case, i).outcome for i, case in cases] == [Outcome.PASS] * 3
    assert [run_case(faulty, case, i).outcome for i, case in cases] == [Outcome.FAIL] * 3


# -- methods the wrapper class does not implement -----------------------------------------------------


class LogitsLeftToTheBase(PunicaWrapperCPU):
    """Inherits everything of PunicaWrapperCPU but declines the logits the way PunicaWrapperBase does."""

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        """Not yet."""
        raise NotImplementedError


class ShrinkLeftAbstract(PunicaWrapperBase):
    """A half-written wrapper: add_shrink (and the other LoRA methods) still abstract."""

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        y.add_(0)


def test_an_abstract_or_not_implemented_method_is_reported_not_implemented_with_its_reason(smoke_cases):
    logits_target = target_over(LogitsLeftToTheBase)
    assert logits_target.add_lora_logits is None and callable(logits_target.add_lora_linear)
    case_id, case = cheapest(smoke_cases, "add_lora_logits", 1)[0]
    result = run_case(logits_target, case, case_id)
    assert result.outcome is Outcome.NOT_SUPPORTED
    assert result.message == "LogitsLeftToTheBase does not implement add_lora_logits: LogitsLeftToTheBase.add_lora_logits only raises NotImplementedError"
    # inherited from PunicaWrapperBase: named as such, in the facts the referee reads too
    facts = facts_of(type(logits_target))
    assert "add_lora_logits" not in facts.methods and "add_lora_w2" not in facts.methods
    assert facts.why_not_implemented["add_lora_w2"].endswith("inherits PunicaWrapperBase.add_lora_w2, which only raises NotImplementedError")

    abstract_target = target_over(ShrinkLeftAbstract)
    implemented = set(abstract_target.implemented_ops())
    assert "add_expand" in implemented and not {"add_shrink", "token_classification_head", "add_lora_linear"} & implemented
    assert abstract_target.not_implemented_reason("add_shrink") == "ShrinkLeftAbstract.add_shrink is abstract: ShrinkLeftAbstract does not implement it"
    assert "ShrinkLeftAbstract.add_shrink is abstract" in abstract_target.not_implemented_reason("token_classification_head")
    # the target's own word wins over the derived one
    declared = target_over(ShrinkLeftAbstract, why_not_implemented={"add_shrink": "our shrink lands in 2.1"})
    assert declared.not_implemented_reason("add_shrink") == "our shrink lands in 2.1"


# -- a wrapper_class or kernel_ops that does not resolve ----------------------------------------------------


@pytest.mark.parametrize(("reference", "says"), [
    ("no_such_vendor.lora.punica:PunicaWrapperChip",
     r"wrapper_class 'no_such_vendor\.lora\.punica:PunicaWrapperChip' does not import \(ModuleNotFoundError: "
     r"No module named 'no_such_vendor'\); pip install no-such-vendor-vllm"),
    ("vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperChip",
     r"module vllm\.lora\.punica_wrapper\.punica_cpu has no PunicaWrapperChip"),
    ("vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU", r"is not a 'package\.module:Class' reference"),
    ("vllm.lora.punica_wrapper.punica_cpu:bgmv_shrink", r"wrapper_class is <function bgmv_shrink .*>, not a class"),
    (None, r"sets no wrapper_class: set it to the vLLM PunicaWrapper subclass"),
])
def test_a_wrapper_class_that_does_not_resolve_is_a_clear_unavailability(reference, says):
    with pytest.raises(TargetUnavailable, match=says):
        target_over(reference, wrapper_package="no-such-vendor-vllm")


def test_kernel_ops_are_bound_by_name_and_checked():
    target = target_over(PunicaWrapperCPU, kernel_ops={"bgmv_shrink": "vllm.lora.ops.torch_ops:bgmv_shrink"})
    from vllm.lora.ops.torch_ops import bgmv_shrink

    assert target.bgmv_shrink is bgmv_shrink and "bgmv_shrink" in target.implemented_ops()
    with pytest.raises(TypeError, match=r"kernel_ops names 'bgmv_shrnk', which is not a kernel op"):
        target_over(PunicaWrapperCPU, kernel_ops={"bgmv_shrnk": bgmv_shrink})


# -- built and fed as vLLM's model manager does; arguments by name -------------------------------------------


class Recording(PunicaWrapperCPU):
    """Records what it is built and fed with; its add_lora_linear takes LoRA bias positionally (an older API)."""

    def __init__(self, max_num_batched_tokens, max_batches, device, **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device)
        self.built = (max_num_batched_tokens, max_batches, kwargs)

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self.fed = (mapping.index_mapping, lora_index_to_id, max_loras)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, scale, output_slices, *, buffer=None, **kwargs):
        self.linear = (lora_bias_stacked, scale, output_slices, kwargs)


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_the_wrapper_is_built_and_fed_as_vllm_does_and_called_by_argument_name():
    from conformance.reference import LoRAMapping

    target = target_over(Recording)
    target.update_metadata(LoRAMapping((0, -1, 2, 2), (0, 2), (1, 1, 2), True, 3))
    tokens, batches, kwargs = target.wrapper.built
    assert (tokens, batches) == (4, 3) and kwargs["lora_config"].max_loras == 3  # vLLM passes a LoRAConfig
    assert target.wrapper.fed == ((1, 0, 3, 3), [1, 2, 3], 4)  # ids = slot + 1; max_loras = slots + 1
    assert target.supports_bias()
    bias = (torch.zeros(3, 1, 6),)
    target.add_lora_linear(torch.zeros(4, 6), torch.zeros(4, 8), (None,), (None,), 0.5, (6,), lora_bias_stacked=bias,
                           add_inputs=False)
    assert target.wrapper.linear == (bias, 0.5, (6,), {"add_inputs": False})  # bias in its place; other keywords as given
