"""The serving level through the worker: its cases run in the target's process, are judged, reported and gated."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.levels import SERVING
from conformance.session import ConformanceRun, RunSettings

HERE = Path(__file__).parent


def run_serving(target: str, report_dir: Path) -> dict:
    run = ConformanceRun(RunSettings(target=target, profile="smoke", report_dir=str(report_dir)), kinds=(SERVING,))
    try:
        return run.run_all()
    finally:
        run.close()


@pytest.mark.integration  # starts the target's worker and its rank pools, 120 + 16 cases
def test_hpu_emulated_serves_every_smoke_serving_case(tmp_path):
    document = run_serving("hpu-emulated", tmp_path)
    results = document["results"]
    assert len(results) == 136 and {r["level"] for r in results} == {"serving"}
    assert sum(r["op"].startswith("tp_") and "placement" in r for r in results) == 16
    assert all(r["outcome"] == "pass" for r in results), [r["message"] for r in results if r["outcome"] != "pass"][:3]
    assert document["gate"]["passed"], document["gate"]
    captured = [r for r in results if "step_capture" in r["features"]]
    assert captured and all("graph(s) captured with" in r["message"] or "piece(s) captured with" in r["message"] for r in captured)


@pytest.mark.integration  # starts the target's worker
def test_a_serving_fault_fails_the_gate_on_stale_state(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # the worker imports the fault's module
    monkeypatch.syspath_prepend(str(HERE))
    document = run_serving("serving_targets:StaleMetadataTail", tmp_path)
    results = document["results"]
    failed = [r for r in results if r["outcome"] == "fail"]
    assert not document["gate"]["passed"]
    assert any(r["family"] == "stale_tail" for r in failed), [r["id"] for r in failed]
    assert all(r["kinds"] == ["stale state"] for r in failed), {tuple(r["kinds"]) for r in failed}
    # the layers it does not implement are not supported, with its reason; nothing else happened to them
    assert {r["outcome"] for r in results} <= {"pass", "fail", "not supported"}
    assert all(r["repro"] and "-k" not in r["repro"] for r in failed)
    assert "stale state" in (tmp_path / "report.html").read_text()


@pytest.mark.integration  # importing vLLM starts a process
def test_a_vllm_wrapper_target_serves_every_step_with_the_one_wrapper_it_built_at_start():
    from conformance.reference import LoRAMapping
    from conformance.targets import load
    from conformance.targets.capture import ServingCapacity

    target = load("cpu")
    target.start_serving(ServingCapacity(max_tokens=64, max_batches=64, num_slots=3, max_rank=16))
    wrapper = target.serving_wrapper
    assert wrapper._token_lora_indices.numel() == 64  # sized to the capacity, not to a batch
    for mapping in (LoRAMapping((0, 0, 1, -1), (0, 1, -1), (2, 1, 1), True, 3), LoRAMapping((2,), (2,), (1,), False, 3)):
        target.update_metadata(mapping)
        assert target.wrapper is wrapper
    fresh = load("cpu")
    fresh.update_metadata(LoRAMapping((2,), (2,), (1,), False, 3))  # no start_serving: a wrapper per batch, as op cases
    assert fresh.wrapper is not None and fresh.wrapper._token_lora_indices.numel() == 1


def test_the_hpu_wrapper_writes_every_batch_into_the_slot_vectors_start_serving_made():
    """A captured graph reads the tensors it saw at capture: the batch's slots must land in them, the tail reset."""
    from conformance.reference import LoRAMapping
    from conformance.targets import load
    from conformance.targets.capture import ServingCapacity

    target = load("hpu-emulated")
    target.start_serving(ServingCapacity(max_tokens=64, max_batches=64, num_slots=3, max_rank=16))
    persistent = target.serving["token"]
    target.update_metadata(LoRAMapping((0, 1, 2, 2, 1, 0), (0, 1, 2), (2, 2, 2), True, 3))
    target.update_metadata(LoRAMapping((2, -1), (2, -1), (1, 1), False, 3))
    assert target.token_rows.slots.untyped_storage().data_ptr() == persistent.untyped_storage().data_ptr()
    assert persistent[:2].tolist() == [2, -1] and (persistent[2:] == -1).all()  # nothing left of the first batch
