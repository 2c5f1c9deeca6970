"""Central, scoped waivers: where an entry came from, its digest, its device scope, and re-checking a record.

A file shipped in the package gives *central* entries (each with an approver), any other file *local* ones;
a matched result's ``expectation`` says which, and the entry's digest, so that ``waiver_check`` can tell
from a record alone whether its known failure was one of the release's waivers, unedited, covering that
case and symptom, unexpired on the run's date and scoped to the device the run recorded.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import shutil

import pytest
from gaudi_fault_targets import gaudi2_entry

import conformance.expectations as expectations
from conformance.expectations import (
    KnownFailure,
    apply_expectations,
    central_entries,
    central_file,
    leading_version,
    load_expectations,
    shipped_expectations,
    waiver_check,
)
from conformance.generator import profile_cases
from conformance.record import CaseResult
from conformance.report import fingerprint
from conformance.verdict import FailureKind, Outcome

RUN_DAY = dt.date(2026, 11, 30)
GAUDI2 = {"device": "hpu: GAUDI2", "driver": "1.20.0-ee698fb", "device_generation": "gaudi2", "target_version": "0.1.0"}
GAUDI3 = {**GAUDI2, "device": "hpu: GAUDI3", "device_generation": "gaudi3"}

GAUDI2_ENTRY = gaudi2_entry()
PLAIN_ENTRY = """
[[known_failure]]
id = "plain"
reason = "r"
upstream = ["https://example.org/issue/1"]
expires = 2027-01-01
approver = "a team"
ops = ["lora_shrink_fp8"]
"""


@pytest.fixture(scope="module")
def fp8_case():
    return next(case for _, case in profile_cases("smoke") if case.op == "lora_shrink_fp8")


@pytest.fixture
def central_dir(tmp_path, monkeypatch):
    """A package whose shipped files are those written into the returned directory."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(expectations, "SHIPPED_DIR", shipped)
    return shipped


def _failure(case, outcome=Outcome.FAIL, kinds=(FailureKind.NUMERICS,), failing_slots=(0,)):
    return CaseResult(case.case_id, case, outcome, "m", features=frozenset({"fp8_tensor"}), failing_slots=failing_slots, kinds=kinds)


def _record(case, entries, device=GAUDI2, **failure):
    """The results record of a failure of ``case`` after the expectations, as results.json holds it."""
    return apply_expectations(_failure(case, **failure), tuple(entries), RUN_DAY, device).to_json()


def _write(directory, name, text):
    path = directory / name
    path.write_text(text)
    return path


# -- the digest ------------------------------------------------------------------------------------------


def test_the_same_entry_gives_the_same_digest_wherever_and_however_it_is_written(tmp_path):
    [first] = load_expectations(_write(tmp_path, "a.toml", GAUDI2_ENTRY))
    reformatted = "# a comment\n" + GAUDI2_ENTRY.replace('kinds = ["numerics"]', 'kinds = [ "numerics" ]   # spaced')
    [second] = load_expectations(_write(tmp_path, "b.toml", reformatted))
    assert first.digest == second.digest == load_expectations(tmp_path / "a.toml")[0].digest
    assert first.digest.startswith("sha256:") and len(first.digest) == len("sha256:") + 64
    assert first.file != second.file  # where it came from is not its content


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("saturates at 240", "saturates at 241"),
        ("2027-06-30", "2027-07-01"),
        ('"fused_moe_lora_fp8"]', '"fused_moe_lora_fp8", "lora_shrink"]'),
        ('kinds = ["numerics"]', 'kinds = ["numerics", "nan/inf"]'),
        ('approver = "lora-conformance maintainers"', 'approver = "someone else"'),
        ('generation = ["gaudi2"]', 'generation = ["gaudi2", "gaudi3"]'),
        ('driver = ">=1.18,<1.22"', 'driver = ">=1.18,<1.23"'),
        ("Inference_Using_FP8.html", "Inference_Using_FP8.html#top"),
    ],
    ids=["reason", "expires", "ops", "kinds", "approver", "generation", "driver", "link"],
)
def test_any_edit_of_an_entry_changes_its_digest(tmp_path, old, new):
    assert old in GAUDI2_ENTRY
    [entry] = load_expectations(_write(tmp_path, "a.toml", GAUDI2_ENTRY))
    [edited] = load_expectations(_write(tmp_path, "b.toml", GAUDI2_ENTRY.replace(old, new)))
    assert edited.digest != entry.digest


def test_the_digest_covers_every_field_but_where_the_entry_was_loaded_from():
    content = {field.name for field in dataclasses.fields(KnownFailure)} - {"source", "file"}
    entry = KnownFailure("e", "r", ("u",), dt.date(2027, 1, 1), ops=("bgmv_*",))
    assert set(entry.canonical()) == content
    assert dataclasses.replace(entry, source="central", file="x.toml").digest == entry.digest


# -- central or local --------------------------------------------------------------------------------------


def test_a_shipped_file_is_central_and_any_other_local_with_the_same_digests(tmp_path, fp8_case):
    shipped = load_expectations(shipped_expectations("cpu"))
    assert {(e.source, e.file) for e in shipped} == {("central", "conformance/expectations/cpu.toml")}
    assert central_file(shipped_expectations("cpu")) == "conformance/expectations/cpu.toml"
    copy = tmp_path / "cpu.toml"
    shutil.copy(shipped_expectations("cpu"), copy)
    local = load_expectations(copy)
    assert {(e.source, e.file) for e in local} == {("local", str(copy))}
    assert [e.digest for e in local] == [e.digest for e in shipped]
    assert set(central_entries()) >= {e.digest for e in shipped}


def test_a_matched_result_records_the_source_file_and_digest_of_its_entry(tmp_path, central_dir, fp8_case):
    [central] = load_expectations(_write(central_dir, "hpu.toml", PLAIN_ENTRY))
    [local] = load_expectations(_write(tmp_path, "mine.toml", PLAIN_ENTRY))
    for entry, source, file in ((central, "central", "conformance/expectations/hpu.toml"), (local, "local", str(tmp_path / "mine.toml"))):
        record = _record(fp8_case, [entry])
        assert record["outcome"] == "known failure"
        assert {key: record["expectation"][key] for key in ("source", "file", "digest")} == {"source": source, "file": file, "digest": central.digest}
        assert record["expectation"]["approver"] == "a team" and record["expectation"]["link"] == "https://example.org/issue/1"


def test_every_shipped_entry_names_its_approver():
    assert central_entries() and all(entry.approver for entry in central_entries().values())


# -- loading refuses ----------------------------------------------------------------------------------------


def test_a_central_entry_without_an_approver_is_refused_naming_it_and_the_fix(tmp_path, central_dir):
    text = PLAIN_ENTRY.replace('approver = "a team"\n', "")
    assert len(load_expectations(_write(tmp_path, "local.toml", text))) == 1  # optional in a local file
    with pytest.raises(ValueError) as caught:
        load_expectations(_write(central_dir, "hpu.toml", text))
    message = str(caught.value)
    assert "entry 1" in message and "'plain'" in message and "approver = " in message and "docs/waivers.md" in message


@pytest.mark.parametrize(
    ("devices", "named"),
    [
        ('devices = { generation = ["gaudi2"], chip = "x" }', "unknown key(s) ['chip']"),
        ('devices = { generation = [] }', "generation must list"),
        ('devices = { driver = "newest" }', "'devices': driver = 'newest' is not a PEP 440 specifier"),
        ('devices = "gaudi2"', "field 'devices' must be a table"),
    ],
    ids=["unknown-key", "no-generation", "bad-driver", "not-a-table"],
)
def test_a_malformed_device_scope_is_refused_naming_the_entry_and_the_allowed_keys(tmp_path, devices, named):
    with pytest.raises(ValueError) as caught:
        load_expectations(_write(tmp_path, "e.toml", PLAIN_ENTRY + devices + "\n"))
    message = str(caught.value)
    assert "e.toml entry 1" in message and named in message
    if "unknown key" in named:
        assert "['driver', 'generation', 'target_version']" in message and "devices = {" in message


# -- the device scope in a run -----------------------------------------------------------------------------


def test_a_gaudi2_entry_applies_on_a_gaudi2_and_not_on_a_gaudi3(tmp_path, fp8_case):
    entries = load_expectations(_write(tmp_path, "e.toml", GAUDI2_ENTRY))
    on_gaudi2 = _record(fp8_case, entries, GAUDI2)
    assert on_gaudi2["outcome"] == "known failure" and on_gaudi2["expectation"]["id"] == "gaudi2-e4m3-range"
    assert on_gaudi2["expectation"]["devices"] == {"generation": ["gaudi2"], "driver": "<1.22,>=1.18"}
    assert on_gaudi2["expectation"]["scope_device"] == {"device_generation": "gaudi2", "driver": "1.20.0-ee698fb", "target_version": "0.1.0"}
    on_gaudi3 = _record(fp8_case, entries, GAUDI3)
    assert on_gaudi3["outcome"] == "fail" and on_gaudi3["expectation"] is None
    assert "known failure gaudi2-e4m3-range not applied: scoped to device generation gaudi2; the case ran on gaudi3" in on_gaudi3["message"]
    # a pass on a Gaudi 3 is a pass, not an unexpected one
    assert apply_expectations(_failure(fp8_case, Outcome.PASS, kinds=()), entries, RUN_DAY, GAUDI3).outcome is Outcome.PASS


def test_a_scoped_entry_is_not_applied_where_the_device_was_not_read_and_the_failure_says_so(tmp_path, fp8_case):
    entries = load_expectations(_write(tmp_path, "e.toml", GAUDI2_ENTRY))
    for device in (None, {"device": "hpu: not read (no process ran a case)"}):
        record = _record(fp8_case, entries, device)
        assert record["outcome"] == "fail"
        assert "scoped to device generation gaudi2, and the generation of the device that ran the case was not read" in record["message"]
    unread_driver = _record(fp8_case, entries, {**GAUDI2, "driver": "unknown (hl-smi not readable)"})
    assert unread_driver["outcome"] == "fail" and "the driver of this run was not read as a version" in unread_driver["message"]
    old_driver = _record(fp8_case, entries, {**GAUDI2, "driver": "1.17.1-abcdef0"})
    assert old_driver["outcome"] == "fail" and "scoped to driver <1.22,>=1.18; the case ran with driver 1.17.1-abcdef0" in old_driver["message"]


def test_an_entry_without_a_scope_applies_on_any_device(tmp_path, fp8_case):
    entries = load_expectations(_write(tmp_path, "e.toml", PLAIN_ENTRY))
    for device in (None, GAUDI2, GAUDI3):
        record = _record(fp8_case, entries, device)
        assert record["outcome"] == "known failure" and "scope_device" not in record["expectation"]


def test_a_driver_compares_by_its_leading_version():
    assert leading_version("1.18.0-ee698fb") == leading_version("1.18.0")
    assert str(leading_version("550.54.15")) == "550.54.15"
    assert leading_version("unknown (hl-smi not readable)") is None and leading_version(None) is None


# -- re-checking a record --------------------------------------------------------------------------------------


def test_a_record_of_a_central_waiver_in_scope_checks(central_dir, fp8_case):
    entries = load_expectations(_write(central_dir, "hpu.toml", GAUDI2_ENTRY))
    assert waiver_check(_record(fp8_case, entries), GAUDI2, RUN_DAY) is None


def test_a_record_of_a_shipped_cpu_waiver_checks_against_the_run_s_vllm(tmp_path):
    case = next(case for _, case in profile_cases("smoke") if case.op == "add_lora_linear")
    result = CaseResult(case.case_id, case, Outcome.BROKEN, "TypeError", features=frozenset({"no_add_inputs"}), kinds=(FailureKind.RAISED,))
    record = apply_expectations(result, load_expectations(shipped_expectations("cpu")), RUN_DAY, {"device_generation": "cpu"}).to_json()
    assert record["expectation"]["id"] == "vllm-cpu-add-lora-linear-add-inputs"
    assert waiver_check(record, {"vllm": "0.32.0", "device_generation": "cpu"}, RUN_DAY) is None


def test_a_local_waiver_is_not_central(tmp_path, central_dir, fp8_case):
    _write(central_dir, "hpu.toml", PLAIN_ENTRY)
    entries = load_expectations(_write(tmp_path, "mine.toml", PLAIN_ENTRY.replace('reason = "r"', 'reason = "ours"')))
    why = waiver_check(_record(fp8_case, entries), GAUDI2, RUN_DAY)
    assert why == f"known failure 'plain' is a local waiver (from {tmp_path / 'mine.toml'}), not one of this release's central waivers"


def test_a_local_copy_of_a_central_entry_is_that_central_waiver(tmp_path, central_dir, fp8_case):
    _write(central_dir, "hpu.toml", PLAIN_ENTRY)
    entries = load_expectations(_write(tmp_path, "mine.toml", PLAIN_ENTRY))  # the same content: the same digest
    assert waiver_check(_record(fp8_case, entries), GAUDI2, RUN_DAY) is None


def test_an_edited_central_entry_is_not_the_central_waiver(central_dir, fp8_case):
    path = _write(central_dir, "hpu.toml", PLAIN_ENTRY)
    record = _record(fp8_case, load_expectations(path))
    path.write_text(PLAIN_ENTRY.replace("2027-01-01", "2029-01-01"))  # the release ships another version of it
    why = waiver_check(record, GAUDI2, RUN_DAY)
    assert why.startswith("known failure 'plain' is not the central entry of that id as shipped") and why.endswith("it was edited")
    forged = {**record, "expectation": {**record["expectation"], "digest": "sha256:" + "0" * 64, "id": "other"}}
    assert waiver_check(forged, GAUDI2, RUN_DAY) == f"known failure 'other' (digest sha256:{'0' * 64}) is not one of this release's central waivers"


@pytest.mark.parametrize(
    ("fingerprint", "reason"),
    [
        (GAUDI3, "does not apply to this run: scoped to device generation gaudi2; the case ran on gaudi3"),
        ({**GAUDI2, "driver": "1.22.0-0a1b2c3"}, "does not apply to this run: scoped to driver <1.22,>=1.18; the case ran with driver 1.22.0-0a1b2c3"),
        ({**GAUDI2, "device_generation": "unknown"}, "the generation of the device that ran the case was not read"),
    ],
    ids=["generation", "driver", "unread"],
)
def test_a_waiver_scoped_to_another_device_or_driver_does_not_check(central_dir, fp8_case, fingerprint, reason):
    record = _record(fp8_case, load_expectations(_write(central_dir, "hpu.toml", GAUDI2_ENTRY)))
    why = waiver_check(record, fingerprint, RUN_DAY)
    assert why.startswith("central known failure 'gaudi2-e4m3-range' (conformance/expectations/hpu.toml)") and reason in why


def test_a_waiver_expired_on_the_run_date_does_not_check(central_dir, fp8_case):
    record = _record(fp8_case, load_expectations(_write(central_dir, "hpu.toml", GAUDI2_ENTRY)))
    assert waiver_check(record, GAUDI2, dt.date(2027, 6, 30)) is None
    assert "expired on 2027-06-30, before the run on 2027-07-01" in waiver_check(record, GAUDI2, dt.date(2027, 7, 1))


def test_a_waiver_that_does_not_match_the_case_does_not_check(central_dir, fp8_case):
    record = _record(fp8_case, load_expectations(_write(central_dir, "hpu.toml", GAUDI2_ENTRY)))
    other_op = {**record, "op": "lora_shrink", "id": record["id"].replace("lora_shrink_fp8", "lora_shrink")}
    assert "does not cover case op:lora_shrink:" in waiver_check(other_op, GAUDI2, RUN_DAY)


def test_a_waiver_whose_symptom_is_not_what_failed_does_not_check(central_dir, fp8_case):
    record = _record(fp8_case, load_expectations(_write(central_dir, "hpu.toml", GAUDI2_ENTRY)))
    crashed = {**record, "kinds": ["nan/inf"]}
    assert "covers failure kinds numerics, not what case" in waiver_check(crashed, GAUDI2, RUN_DAY)
    assert "not the suite's" in waiver_check({**record, "kinds": ["melted"]}, GAUDI2, RUN_DAY)


def test_a_waiver_outside_its_version_range_does_not_check():
    case = next(case for _, case in profile_cases("smoke") if case.op == "bgmv_shrink")
    result = CaseResult(case.case_id, case, Outcome.FAIL, "m", features=frozenset({"neg1"}), failing_slots=(-1,), kinds=(FailureKind.NUMERICS,))
    record = apply_expectations(result, load_expectations(shipped_expectations("cpu")), RUN_DAY).to_json()
    assert record["expectation"]["id"] == "vllm-cpu-no-adapter-rows"
    assert waiver_check(record, {"vllm": "0.32.0"}, RUN_DAY) is None
    assert "needs vllm <0.33; installed: 0.33.0" in waiver_check(record, {"vllm": "0.33.0"}, RUN_DAY)
    ran = {"vllm": "0.32.0", "target_package_versions": {"vllm": "0.33.0"}}  # the target ran 0.33.0's ops
    assert "the target runs vllm 0.33.0 (installed: 0.32.0)" in waiver_check(record, ran, RUN_DAY)


def test_a_record_without_an_entry_does_not_check(fp8_case):
    assert waiver_check(_failure(fp8_case).to_json(), GAUDI2, RUN_DAY) == "the record names no expectations entry"


# -- the fingerprint's device generation -----------------------------------------------------------------------


def test_the_fingerprint_names_the_device_generation(monkeypatch):
    assert [fingerprint.gaudi_generation(name) for name in ("GAUDI2", "GAUDI3", "GAUDI", "Gaudi2", "HL-325L")] == [
        "gaudi2", "gaudi3", "gaudi1", "gaudi2", "hl-325l"]
    assert fingerprint.device_description("cpu")["device_generation"] == "cpu"
    assert fingerprint.device_description("mychip")["device_generation"] == "unknown"
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert fingerprint.device_description("cuda")["device_generation"] == "sm_90"
