"""The "full target" starting point of docs/bring-up.md: ``examples/full-target-backend``.

* installed (``scripts/install-cpu-env`` does it), it is registered as ``full-target-example`` and passes
  the smoke gate, run as a vendor runs it (pytest in a subprocess): the tensor-parallel and end-to-end
  cases pass on its five methods (the MoE ones are not supported), and no op case is "not supported"
  but the ops it leaves out;
* a fault seeded into it (LoRA bias scaled with the adapter, a classic misreading of vLLM's bias) is
  caught by those same cases, and only by the ones with LoRA bias.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from example_backends import installed_example

from conformance.generator.profiles import profile_cases
from conformance.runner import run_case
from conformance.verdict import Outcome


@pytest.fixture(scope="module")
def example_class():
    return installed_example("full_target_backend", "FullTargetExample", "full-target-backend")


@pytest.mark.integration  # the example backend's whole smoke run, as a vendor runs it (about 3 minutes on 2 busy cores)
def test_it_passes_the_smoke_gate(tmp_path, example_class):
    report = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance", "--target=full-target-example", "--profile=smoke",
         f"--report-dir={report}", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=tmp_path, timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((report / "results.json").read_text())["results"]
    # the tensor-parallel and end-to-end cases run on its five methods; only the MoE ones need what it left out
    layers_and_models = [r for r in results if r["level"] in ("layer", "model")]
    assert any(r["outcome"] == Outcome.PASS.value for r in layers_and_models)
    assert all(r["outcome"] == Outcome.PASS.value or "add_lora_w13" in r["message"] for r in layers_and_models)
    outcomes = {(r["op"], r["outcome"]) for r in results if r["level"] in ("kernel", "wrapper")}
    left_out = set(example_class.why_not_implemented)
    implemented = {op for op, outcome in outcomes if outcome == Outcome.PASS.value}
    assert implemented == {"add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding", "add_lora_logits"}
    assert {op for op, outcome in outcomes if outcome == Outcome.NOT_SUPPORTED.value} - left_out == {
        op for op, _ in outcomes if op not in implemented and op not in left_out  # the kernel ops: none defined
    }


def test_a_seeded_fault_is_caught_by_the_bias_cases(example_class):
    class BiasScaledWithTheAdapter(example_class):
        def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, *, lora_bias_stacked=None, **kwargs):
            if lora_bias_stacked is not None:
                lora_bias_stacked = [None if b is None else b * 2 for b in lora_bias_stacked]
            super().add_expand(y, x, lora_b_stacked, output_slices, offset_start, add_inputs, lora_bias_stacked=lora_bias_stacked)

    cases = [(case_id, case) for case_id, case in profile_cases("smoke") if case.op == "add_lora_linear"]
    correct, faulty = example_class(), BiasScaledWithTheAdapter()
    for case_id, case in cases:
        assert run_case(correct, case, case_id).outcome is Outcome.PASS, case_id
    failing = {case_id for case_id, case in cases if run_case(faulty, case, case_id).outcome is Outcome.FAIL}
    assert failing == {case_id for case_id, case in cases if case.bias}
    assert failing  # the smoke profile draws bias cases of add_lora_linear
