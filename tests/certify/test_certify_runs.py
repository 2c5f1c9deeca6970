"""certify and verify end to end, as a vendor and a reviewer run them: real runs of the released smoke list.

* ``hpu-emulated`` in two shards (``lora-conformance run --caselist smoke --shard I/2``), bundled with
  ``certify --from``: verifies 0, with ``--rejudge`` too; the statement restated filled, still 0;
* a seeded-fault target (``fault_targets:BiasScaled``: the LoRA bias multiplied by the scale; three cases of
  smoke fail, so the run costs what a good one does) certified in one run: the bundle is written and
  verifies 1, naming the failing cases;
* that real bundle forged (a failed case edited to pass, its digest and index recomputed): verifies 2,
  naming the case and its budget ratio.

Each command runs in a subprocess, as a vendor's CI does (integration tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conformance.certify import archive
from conformance.certify.bundle import RESULTS, STATEMENT
from conformance.certify.statement import VENDOR_FIELDS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"  # the seeded-fault targets live in tests/
FAULT = "fault_targets:BiasScaled"


def started(*args: str, cwd: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):  # when these tests run under xdist
        env.pop(name, None)
    command = [sys.executable, "-m", "conformance.cli", *args]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finished(process: subprocess.Popen, timeout: int = 900) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def suite(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return finished(started(*args, cwd=cwd))


def output(completed: subprocess.CompletedProcess) -> str:
    return completed.stdout[-4000:] + completed.stderr[-4000:]


@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("good")
    shards = [work / f"shard-{index}" for index in range(2)]
    runs = [started("run", "--target=hpu-emulated", "--caselist", "smoke", f"--shard={index}/2", "-q", "-p", "no:cacheprovider",
                    "--progress-every=0", "--report-dir", str(report)) for index, report in enumerate(shards)]  # side by side, as on two machines
    for run in runs:
        completed = finished(run)
        assert completed.returncode == 0, output(completed)
    bundle = work / "hpu-emulated-smoke-bundle.tar.gz"
    completed = suite("certify", "--from", *map(str, shards), "--out", str(bundle))
    assert completed.returncode == 0, output(completed)
    assert f"bundle: {bundle}" in completed.stdout and "verdict: CONFORMANT" in completed.stdout
    return bundle


@pytest.fixture(scope="module")
def faulty_bundle(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    work = tmp_path_factory.mktemp("faulty")
    completed = suite("certify", f"--target={FAULT}", "--caselist", "smoke", "-n", "2", "-q", "-p", "no:cacheprovider",
                      "--progress-every=0", "--report-dir", str(work / "report"), cwd=work)
    assert completed.returncode == 1, output(completed)
    bundle = work / "fault_targets_BiasScaled-smoke-bundle.tar.gz"  # the default name, in the working directory
    assert bundle.is_file(), output(completed)
    return bundle, completed


def test_a_sharded_good_run_verifies_conformant(good_bundle):
    completed = suite("verify", str(good_bundle))
    assert completed.returncode == 0, output(completed)
    assert "statement: not filled" in completed.stdout
    members, _ = archive.read_archive(good_bundle)
    results = json.loads(members[RESULTS])
    listed = json.loads((ROOT / "conformance" / "caselists" / "smoke.jsonl").read_text().splitlines()[0])
    assert len(results["results"]) == listed["count"] and results["caselist"]["digest"] == listed["digest"]
    assert {"manifests/input-1.json", "manifests/input-2.json"} <= set(members)
    assert all(r.get("inputs_digest") for r in results["results"] if r["outcome"] != "not supported")


def test_rejudge_recomputes_sampled_oracles(good_bundle):
    completed = suite("verify", str(good_bundle), "--rejudge", "4", "--seed", "3")
    assert completed.returncode == 0, output(completed)
    assert "rejudge: 4 case(s) of smoke, seed 3" in completed.stdout


def test_a_filled_statement_is_restated_into_the_bundle(good_bundle, tmp_path):
    with tarfile.open(good_bundle) as tar:
        text = tar.extractfile(STATEMENT).read().decode()
    for name in VENDOR_FIELDS:
        text = text.replace(f'{name} = ""', f'{name} = "the {name}"')
    (tmp_path / "statement.toml").write_text(text)
    restated = tmp_path / "restated.tar.gz"
    completed = suite("certify", "--restate", str(good_bundle), "--statement", str(tmp_path / "statement.toml"), "--out", str(restated))
    assert completed.returncode == 0, output(completed)
    completed = suite("verify", str(restated))
    assert completed.returncode == 0 and "statement: filled" in completed.stdout, output(completed)


def test_a_seeded_fault_target_verifies_not_conformant(faulty_bundle):
    bundle, certified = faulty_bundle
    completed = suite("verify", str(bundle))
    assert completed.returncode == 1, output(completed)
    assert "not conformant: results.json:" in completed.stdout and "ended 'fail'" in completed.stdout
    assert not any(line.startswith("invalid:") for line in completed.stdout.splitlines())


def test_a_real_failure_edited_to_pass_is_invalid(faulty_bundle, tmp_path):
    from bundles import forged  # the forger of the unit tests, on a real bundle

    members, _ = archive.read_archive(faulty_bundle[0])
    failed = next(r for r in json.loads(members[RESULTS])["results"] if r["outcome"] == "fail" and "numerics" in r["kinds"])

    def to_pass(doc):
        next(r for r in doc["results"] if r["id"] == failed["id"]).update(outcome="pass", kind=None, kinds=[])

    path = archive.write_archive(forged(members, to_pass, released=None), tmp_path / "forged.tar.gz")
    completed = suite("verify", str(path))
    assert completed.returncode == 2, output(completed)
    [line] = [line for line in completed.stdout.splitlines() if line.startswith("invalid:")]
    assert line.startswith(f"invalid: results.json record {failed['id']}: recorded pass, but its measurement (budget_ratio ")
    assert "the error exceeds its budget" in line
