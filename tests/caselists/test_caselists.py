"""Frozen case lists (conformance.caselists): what a list holds, what a run of one does, what it refuses."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conformance.caselists import (
    CaselistEntry,
    CaselistError,
    fingerprints_agree,
    load_caselist,
    oracle_fingerprint,
    rejudge_entry,
    released_caselists,
    write_caselist,
)
from conformance.digest import json_digest, tensors_digest
from conformance.errors import RunError
from conformance.generator import profile_cases
from conformance.levels import LAYER, OP
from conformance.session import ConformanceRun, RunSettings
from conformance.targets.facts import facts_of
from conformance.targets.reference import ReferenceTarget
from conformance.tp.cases import tp_cases

HEADER = {"suite_version": "test", "profile": "smoke", "seed": 0, "generated_with": {}}


def small_list(path, ops: int = 6, layers: int = 2, name: str = "small"):
    """A list of the smoke profile's first op cases and tensor-parallel cases, as ``freeze`` writes them."""
    entries = [CaselistEntry(case_id, "op", case.to_json(), OP.inputs_digest(case)) for case_id, case in profile_cases("smoke")[:ops]]
    entries += [CaselistEntry(case.case_id, "layer", case.to_json(), LAYER.inputs_digest(case)) for case in tp_cases("smoke")[:layers]]
    return write_caselist(path, name, HEADER, entries)


@pytest.fixture(autouse=True)
def no_fingerprint(monkeypatch):
    """The environment fingerprint asks git and device tools in subprocesses: not in the unit tier."""
    import conformance.session

    monkeypatch.setattr(conformance.session, "environment_fingerprint", lambda **kwargs: {})


def run_of(tmp_path, **settings) -> ConformanceRun:
    return ConformanceRun(RunSettings(target="reference", report_dir=str(tmp_path / "report"), **settings), facts=facts_of(ReferenceTarget))


def test_a_list_reads_back_and_any_edit_is_refused(tmp_path):
    written = small_list(tmp_path / "small.jsonl")
    again = load_caselist(tmp_path / "small.jsonl")
    assert again.digest == written.digest and [e.case_id for e in again.entries] == [e.case_id for e in written.entries]
    lines = (tmp_path / "small.jsonl").read_text().splitlines()
    edited = json.loads(lines[2])
    edited["case"]["seed"] += 1
    (tmp_path / "edited.jsonl").write_text("\n".join([lines[0], lines[1], json.dumps(edited), *lines[3:]]) + "\n")
    with pytest.raises(CaselistError, match="edited after it was written"):
        load_caselist(tmp_path / "edited.jsonl")
    (tmp_path / "short.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(CaselistError, match="truncated or edited"):
        load_caselist(tmp_path / "short.jsonl")
    (tmp_path / "twice.jsonl").write_text("\n".join([*lines, lines[1]]) + "\n")
    with pytest.raises(CaselistError, match="listed twice"):
        load_caselist(tmp_path / "twice.jsonl")
    with pytest.raises(CaselistError, match="give a shipped list's name"):
        load_caselist("no-such-list")


def test_the_shipped_lists_load_and_hold_every_level():
    shipped = released_caselists()
    assert {"smoke", "standard", "release"} <= set(shipped)
    smoke = load_caselist("smoke")
    assert smoke.profile == "smoke" and smoke.seed == 0
    assert {entry.level for entry in smoke.entries} == {"op", "model", "layer", "serving"}
    assert all(entry.inputs_digest.startswith("sha256:") for entry in smoke.entries)


def test_a_list_run_runs_exactly_the_list_without_drawing(tmp_path, monkeypatch):
    small = small_list(tmp_path / "small.jsonl")
    from conformance.generator import profiles

    def no_drawing(*args, **kwargs):
        raise AssertionError("a --caselist run drew cases")

    monkeypatch.setattr(profiles, "cached_cases", no_drawing)  # every profile's cases, drawn or cached, come through it
    run = run_of(tmp_path, caselist=str(small.path))
    assert list(run.cases_by_id()) == [entry.case_id for entry in small.entries]
    assert (run.profile, run.seed) == ("smoke", 0)
    manifest = run.manifest(list(run.cases_by_id()))
    assert manifest["caselist"] == {**small.summary(), "given": str(small.path)}
    assert manifest["case_list"]["count"] == len(small.entries)


def test_a_list_run_refuses_other_options_levels_and_inputs(tmp_path):
    small = small_list(tmp_path / "small.jsonl")
    with pytest.raises(RunError, match="frozen from --profile=smoke, not standard"):
        run_of(tmp_path, caselist=str(small.path), profile="standard")
    with pytest.raises(RunError, match="frozen from --seed=0, not 3"):
        run_of(tmp_path, caselist=str(small.path), seed=3)
    strange = write_caselist(tmp_path / "strange.jsonl", "strange", HEADER, [CaselistEntry("gpu:x", "gpu", {}, "sha256:0")])
    with pytest.raises(RunError, match=r"level\(s\) \['gpu'\], which this installation does not have"):
        run_of(tmp_path, caselist=str(strange.path))
    other = [CaselistEntry(e.case_id, e.level, e.case_json, json_digest("other values")) for e in small.entries]
    drawn_elsewhere = write_caselist(tmp_path / "elsewhere.jsonl", "elsewhere", HEADER, other)
    with pytest.raises(RunError, match=f"draws other input values .* torch {re.escape(torch.__version__)} here"):
        run_of(tmp_path, caselist=str(drawn_elsewhere.path))


def test_a_list_run_records_what_each_verdict_was_reached_on(tmp_path):
    small = small_list(tmp_path / "small.jsonl", ops=4, layers=0)
    run = ConformanceRun(RunSettings(target="reference", report_dir=str(tmp_path / "report"), caselist=str(small.path), isolation="none"))
    document = run.run_all()
    assert document["gate"]["passed"] and document["caselist"]["digest"] == small.digest
    by_id = {record["id"]: record for record in document["results"]}
    for entry in small.entries:
        record = by_id[entry.case_id]
        assert record["inputs_digest"] == entry.inputs_digest
        again = rejudge_entry(entry)  # the reviewer's recomputation, from the list alone
        assert again["inputs_digest"] == entry.inputs_digest
        assert fingerprints_agree(record["oracle_fingerprint"], again["oracle_fingerprint"])


def test_digests_see_one_bit_and_fingerprints_see_values_not_summation_order():
    values = {"x": torch.randn(8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(torch.bfloat16)}
    flipped = {"x": values["x"].clone()}
    flipped["x"].view(torch.int16)[3, 5] ^= 1
    assert tensors_digest(values) == tensors_digest({"x": values["x"].clone()})
    assert tensors_digest(values) != tensors_digest(flipped)
    assert tensors_digest(values) != tensors_digest({"x": values["x"].reshape(16, 8)})
    assert tensors_digest(values) != tensors_digest({"y": values["x"]})
    oracle = torch.randn(64, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reordered = (oracle.reshape(64, 8, 64).sum(-1, keepdim=True) * 0 + oracle.reshape(64, 8, 64)).reshape(64, 512)
    assert fingerprints_agree(oracle_fingerprint(oracle), oracle_fingerprint(reordered))
    assert fingerprints_agree(oracle_fingerprint(oracle), oracle_fingerprint(oracle * (1 + 1e-14)))  # last-bit summation noise
    assert not fingerprints_agree(oracle_fingerprint(oracle), oracle_fingerprint(oracle * (1 + 1e-6)))
    assert not fingerprints_agree(oracle_fingerprint(oracle), oracle_fingerprint(oracle.flip(0)))  # the same values elsewhere
    with_inf = oracle.clone()
    with_inf[0, 0] = float("-inf")
    assert not fingerprints_agree(oracle_fingerprint(oracle), oracle_fingerprint(with_inf))
    assert not fingerprints_agree(["not", "numbers"], oracle_fingerprint(oracle))


@pytest.mark.integration  # draws the smoke profile (or reads it from the disk cache) and every case's inputs: ~20 s
def test_the_shipped_smoke_list_is_what_this_suite_draws(capsys):
    """A change to what a case is or how it is drawn must come with regenerated lists: python -m conformance.caselists write."""
    from conformance.caselists.__main__ import main

    assert main(["check", "smoke"]) == 0, capsys.readouterr().out


@pytest.mark.slow  # the standard profile and its inputs: ~2 min
def test_the_shipped_standard_list_is_what_this_suite_draws(capsys):
    from conformance.caselists.__main__ import main

    assert main(["check", "standard"]) == 0, capsys.readouterr().out
