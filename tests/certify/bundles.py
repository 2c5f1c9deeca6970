"""Synthetic bundles, built in this process, and the forger's tools to edit them.

A small frozen list (``mini``, six cases, written with ``conformance.caselists.write_caselist``) stands in
for a released one: each test passes ``released={"mini": path}`` to the checks. Its records are made here
with the fields a run writes (``CaseResult.to_json``); a known failure uses a real central waiver of the
shipped ``cpu.toml`` (``vllm-cpu-add-lora-linear-add-inputs``: ``add_lora_linear`` with ``no_add_inputs``
raises), so the waiver check runs for real.

The forger (:func:`forged`) edits the results and then redoes whatever certify would, as a careful forger
would: the record digests (unless told not to), the verdict, the certificate and the hash index (unless
told not to), so that each test sees the one check its forgery cannot pass.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
from pathlib import Path

import conformance
from conformance.caselists import CaselistEntry, write_caselist
from conformance.certify import archive
from conformance.certify.bundle import DIGESTS, RESULTS, content_members
from conformance.certify.records import record_digest
from conformance.certify.statement import template
from conformance.certify.verify import finish
from conformance.expectations import load_expectations, shipped_expectations

CREATED = _dt.date(2026, 3, 2)
FINISHED = _dt.datetime(2026, 3, 1, 12, tzinfo=_dt.UTC).timestamp()
CENTRAL_WAIVER = "vllm-cpu-add-lora-linear-add-inputs"
PASSING = {"max_abs_error": 1e-3, "scaled_error": 1e-3, "max_ulp": 1.0, "sqnr_db": 60.0, "baseline_error": 1e-3, "budget": 4e-3,
           "budget_ratio": 0.25, "output_scale": 1.0, "checked_elements": 64, "operand_scale": 1.0, "magnitude_scale": 2.0,
           "delta_bias": 1e-4, "delta_bias_se": 1e-4, "delta_bias_threshold": 1e-3, "systematic_ratio": 0.1, "baseline_delta_bias": 0.0,
           "error_rms": 1e-4, "expected_rms": 1e-4, "precision_ratio": 1.0, "precision_threshold": 2.5, "bit_differences": []}
# the failing measurement of issue 34: an error 41,750 times its budget
FAILING = {**PASSING, "max_abs_error": 167.0, "budget_ratio": 41750.0, "systematic_ratio": 957.0}


def case_of(op: str, n: int, **extra) -> dict:
    return {"op": op, "dtype": "bfloat16", "seq_lens": [n + 1], "hidden_size": 64 + n, "seed": 1000 + n, **extra}


def inputs_of(n: int) -> str:
    return f"sha256:{n:064x}"


CASES = [  # (id, op, features)
    ("op:bgmv_shrink:dtype=bf16;n=0", "bgmv_shrink", []),
    ("op:bgmv_expand:dtype=bf16;n=1", "bgmv_expand", ["neg1"]),
    ("op:lora_shrink:dtype=bf16;n=2", "lora_shrink", []),
    ("op:add_lora_linear:dtype=bf16;n=3", "add_lora_linear", ["no_add_inputs"]),
    ("op:sgmv_shrink:dtype=bf16;n=4", "sgmv_shrink", []),
    ("op:add_expand:dtype=bf16;n=5", "add_expand", []),
]


def write_list(directory: Path, name: str = "mini"):
    """The synthetic list, written as the lead's tools write a released one."""
    entries = [CaselistEntry(case_id, "op", case_of(op, n), inputs_of(n)) for n, (case_id, op, _) in enumerate(CASES)]
    header = {"suite_version": conformance.__version__, "profile": "smoke", "seed": 0,
              "generated_with": {"hypothesis": "test", "torch": "test", "python": "test"}}
    return write_caselist(directory / f"{name}.jsonl", name, header, entries)


def central_waiver() -> dict:
    [entry] = [e for e in load_expectations(shipped_expectations("cpu")) if e.id == CENTRAL_WAIVER]
    return entry.to_json()


def record(n: int, outcome: str = "pass", measurement: dict | None = PASSING, kinds=(), expectation=None) -> dict:
    case_id, op, features = CASES[n]
    return {
        "id": case_id, "op": op, "level": "kernel", "dtype": "bfloat16", "family": "random", "features": list(features),
        "outcome": outcome, "kind": kinds[0] if kinds else None, "kinds": list(kinds), "message": "",
        "measurement": measurement, "seconds": 0.01, "failing_slots": [], "failing_slices": [], "expectation": expectation,
        "replay": None, "repro": None, "stability": "deterministic", "determinism": None, "case": case_of(op, n),
        "inputs_digest": inputs_of(n), "oracle_fingerprint": [64.0, 0.0, 1.5, 20.0, 12.0, 0.75], "worker": "gw0", "finished": FINISHED,
    }


def document(caselist, records: list[dict], target: str = "synthetic") -> dict:
    return {
        "suite_version": conformance.__version__, "target": target, "target_name": target, "target_class": "tests:Synthetic",
        "profile": "smoke", "seed": 0, "shard": None, "expectations": None, "expectations_not_applicable": [],
        "caselist": caselist.summary(), "target_version": conformance.__version__, "target_package_versions": {},
        "environment": {"suite_version": conformance.__version__, "torch": "2.x", "vllm": "0.32.0", "device": "cpu: test", "driver": "n/a"},
        "workers": [{"worker": "gw0", "pid": 1, "device": "cpu: test", "driver": "n/a", "device_generation": "cpu"}],
        "gate": {"passed": True}, "results": records,
    }


def passing_records() -> list[dict]:
    return [record(n) for n in range(len(CASES))]


def known_failure_records(expectation: dict) -> list[dict]:
    """Every case passes but ``add_lora_linear`` (no_add_inputs), which raises: a known failure under ``expectation``."""
    records = passing_records()
    records[3] = record(3, "known failure", None, ("raised",), expectation)
    return records


def members_of(caselist, records: list[dict], released: dict, statement: bytes | None = None, target: str = "synthetic") -> dict[str, bytes]:
    """A complete bundle's members, as certify writes them."""
    doc = document(caselist, records, target)
    content = content_members([doc], ["report/synthetic"], b"", created=CREATED)
    content["statement.toml"] = statement or template(target, caselist.name, caselist.digest)
    members, _ = finish(content, released)
    return members


def results_of(members: dict[str, bytes]) -> dict:
    return json.loads(members[RESULTS])


def forged(members: dict[str, bytes], edit, released: dict, *, redigest: bool = True, reindex: bool = True) -> dict[str, bytes]:
    """``members`` with the results document edited by ``edit(document)``, then re-signed as far as told:
    record digests recomputed (``redigest``), and the verdict, certificate and index redone (``reindex``)."""
    members = dict(members)
    doc = copy.deepcopy(results_of(members))
    edit(doc)
    members[RESULTS] = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    if redigest:
        digests = json.loads(members[DIGESTS])
        inputs = {item["id"]: item["input"] for item in digests["records"]}
        digests["records"] = [{"id": r["id"], "digest": record_digest(r), "input": inputs.get(r["id"], 1)} for r in doc["results"]]
        members[DIGESTS] = (json.dumps(digests, indent=1, sort_keys=True) + "\n").encode()
    if not reindex:
        return members
    return finish(members, released)[0]


def write(members: dict[str, bytes], path: Path) -> Path:
    return archive.write_archive(members, path)
