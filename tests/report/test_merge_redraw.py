"""`merge` draws the profile's cases again and refuses a result whose case is not the one drawn under its id.

A shard's results.json names each case by id and records the case itself (``case``); the merged verdict
is only about the profile's cases if every recorded case is the one the profile draws under that id.
The shard here is a small real run on the `reference` target (three op cases, one tensor-parallel and
one end-to-end case of the smoke profile); its copies are edited the way a hand edit would be, keeping
the outcome, and merged through the command and through ``merge_documents``.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ROOT, conformance, results

from conformance.cases.replay import write_replay
from conformance.generator import profile_cases
from conformance.report import MergeError, merge_documents
from conformance.runner import make_values

SELECTION = ("op:bgmv_shrink:family=random;*", "layer:column:tp=2;dtype=fp32;fully_sharded=0;*", "model:teacher_forced_logits:batch=mixed;dtype=fp32")
HYPOTHESIS = importlib.metadata.version("hypothesis")


def merge(paths: list[Path], out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "conformance.report", "merge", *map(str, paths), "--out", str(out)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> dict:
    report_dir = tmp_path_factory.mktemp("shard")
    completed = conformance("--target=reference", "--profile=smoke", *(f"--cases={query}" for query in SELECTION), report_dir=report_dir)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    document = results(report_dir)
    assert sorted(r["id"].split(":")[0] for r in document["results"]) == ["layer", "model", "op", "op", "op"]
    assert document["hypothesis_version"] == HYPOTHESIS
    return document


def _by_id(document: dict, prefix: str) -> dict:
    return next(r for r in document["results"] if r["id"].startswith(prefix))


def test_an_unedited_shard_merges(shard, tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(shard))
    completed = merge([path], tmp_path / "merged")
    # the selection leaves the profile's other cases without a result: a failing gate (1), not a refusal (2)
    assert completed.returncode == 1 and "cannot merge" not in completed.stderr, completed.stderr
    merged = results(tmp_path / "merged")
    assert [r["id"] for r in merged["results"]] == [r["id"] for r in shard["results"]]
    assert all(r["outcome"] == "pass" for r in merged["results"])


def test_a_result_whose_case_was_edited_is_refused_naming_file_case_and_field(shard, tmp_path):
    edited = copy.deepcopy(shard)
    result = _by_id(edited, "op:bgmv_shrink:")
    result["case"]["scale"] = result["case"]["scale"] * 2 + 1  # another case, still recorded as a pass
    path = tmp_path / "shard0" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(edited))
    completed = merge([path], tmp_path / "merged")
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert str(path) in completed.stderr and result["id"] in completed.stderr and "'scale'" in completed.stderr
    assert "rerun the shard" in completed.stderr
    assert not (tmp_path / "merged" / "results.json").exists()


@pytest.mark.parametrize(
    ("prefix", "field", "value"),
    [("op:bgmv_shrink:", "seed", 1), ("layer:", "tp_size", 4), ("model:teacher_forced", "max_loras", 1)],
    ids=["op", "tensor-parallel", "end-to-end"],
)
def test_every_level_of_case_is_checked(shard, prefix, field, value):
    edited = copy.deepcopy(shard)
    result = _by_id(edited, prefix)
    result["case"][field] = value
    with pytest.raises(MergeError, match=f"s0.json: case {result['id']} records '{field}' = {value}, but profile smoke seed 0 draws"):
        merge_documents([edited], ["s0.json"])


def test_a_result_under_an_id_the_profile_does_not_draw_is_refused(shard):
    edited = copy.deepcopy(shard)
    _by_id(edited, "op:bgmv_shrink:")["id"] = "op:bgmv_shrink:dtype=fp32;slices=1;rank=16;family=imaginary"
    with pytest.raises(MergeError, match="case op:bgmv_shrink:dtype=fp32;slices=1;rank=16;family=imaginary is not a case of profile smoke seed 0"):
        merge_documents([edited], ["s0.json"])


def test_a_shard_drawn_with_another_hypothesis_is_refused(shard):
    other = {**copy.deepcopy(shard), "hypothesis_version": "6.0.0"}
    with pytest.raises(MergeError, match=f"s0.json was drawn with Hypothesis 6.0.0, but this environment has {HYPOTHESIS}"):
        merge_documents([other], ["s0.json"])


def test_a_shard_without_its_hypothesis_version_is_checked_by_drawing_again(shard):
    older = copy.deepcopy(shard)
    del older["hypothesis_version"]
    assert [r["id"] for r in merge_documents([older], ["s0.json"])["results"]] == [r["id"] for r in shard["results"]]
    _by_id(older, "op:bgmv_shrink:")["case"]["scale"] = 1e3
    with pytest.raises(MergeError, match="'scale'.*records no Hypothesis version, so the one that drew it is unknown"):
        merge_documents([older], ["s0.json"])


def test_a_replay_run_merges_as_before(tmp_path):
    case_id, case = profile_cases("smoke", 0)[0]
    replay = write_replay(tmp_path / "replays", case_id, case, make_values(case), target="reference")
    completed = conformance("--target=reference", "--replay", str(replay), report_dir=tmp_path / "replayed")
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert results(tmp_path / "replayed")["profile"] == "replay"
    completed = merge([tmp_path / "replayed" / "results.json"], tmp_path / "merged")
    assert completed.returncode == 0 and completed.stdout.startswith("verdict: PASS"), completed.stdout + completed.stderr
