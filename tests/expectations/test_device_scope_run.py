"""A device-scoped entry in a run: evaluated against the device the worker that ran the case reported.

``gaudi_fault_targets`` saturates fp8 codes at ±240, as a port casting e4m3fn codes to Gaudi 2's e4m3 would,
and reports a Gaudi 2 or a Gaudi 3 from its worker process. The referee's process reads no device: the
entry scoped to Gaudi 2 turns the failures into known failures on the one, and stays out on the other,
where each failure says why."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from gaudi_fault_targets import gaudi2_entry

from conformance.expectations import waiver_check
from conformance.session import ConformanceRun, RunSettings

pytestmark = pytest.mark.integration  # a whole run: the target's facts and its cases in worker processes

def _run(tmp_path, target: str) -> dict:
    path = tmp_path / "gaudi.toml"
    path.write_text(gaudi2_entry(expires="2099-12-31"))  # judged on the day it runs
    settings = RunSettings(target=f"gaudi_fault_targets:{target}", profile="smoke", report_dir=str(tmp_path / target),
                           cases=["op:lora_shrink_fp8:dtype=bf16;*"], expectations=str(path))
    return ConformanceRun(settings).run_all()


@pytest.mark.parametrize(("target", "outcome"), [("SaturatingOnGaudi2", "known failure"), ("SaturatingOnGaudi3", "fail")])
def test_the_scope_is_evaluated_against_the_device_the_worker_reported(tmp_path, target, outcome):
    document = _run(tmp_path, target)
    results = document["results"]
    assert results and {r["outcome"] for r in results} == {outcome}
    [worker] = document["workers"]
    generation = worker["device_generation"]
    assert generation == target[-6:].lower() and worker["driver"] == "1.20.0-ee698fb"
    assert document["environment"]["device_generation"] == generation
    fingerprint = {**worker, "target_version": document["target_version"]}
    for record in results:
        if outcome == "known failure":
            assert record["expectation"]["source"] == "local" and record["expectation"]["scope_device"]["device_generation"] == "gaudi2"
            assert "is a local waiver" in waiver_check(record, fingerprint, dt.date.today())
        else:
            assert "known failure gaudi2-e4m3-range not applied: scoped to device generation gaudi2; the case ran on gaudi3" in record["message"]
    json.dumps(document)  # what results.json holds

