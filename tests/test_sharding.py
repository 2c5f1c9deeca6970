"""`--shard=auto`: the shard a CI system or cluster names is the explicit `--shard=I/N` one.

The unit tests set each system's variables (monkeypatch) and read what the detection makes of them,
of conflicts and of malformed values. The command-line tests run the suite in subprocesses on the
`reference` target, as each system's split jobs would: every index with that system's variables,
compared with the explicit shards and merged into the unsharded run.

The variables are written out here as each system documents them, not read from
`conformance.sharding`, so that a wrong name or base there fails a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ROOT, error_lines, results

from conformance import sharding
from conformance.journal import case_list_summary
from conformance.session import ConformanceRun

# system → the variables it sets in copy `index` (0-based) of `count`
CI_VARIABLES = {
    "GitLab CI": lambda index, count: {"CI_NODE_INDEX": str(index + 1), "CI_NODE_TOTAL": str(count)},  # 1-based
    "Buildkite": lambda index, count: {"BUILDKITE_PARALLEL_JOB": str(index), "BUILDKITE_PARALLEL_JOB_COUNT": str(count)},
    "CircleCI": lambda index, count: {"CIRCLE_NODE_INDEX": str(index), "CIRCLE_NODE_TOTAL": str(count)},
    # Kubernetes sets the index; the Job's manifest sets the count from its spec.completions (examples/ci/kubernetes-indexed-job.yaml)
    "Kubernetes Indexed Job": lambda index, count: {"JOB_COMPLETION_INDEX": str(index), "LORA_CONFORMANCE_JOB_COMPLETIONS": str(count)},
}
EVERY_VARIABLE = sorted({name for variables in CI_VARIABLES.values() for name in variables(0, 1)})


@pytest.fixture
def ci_env(monkeypatch):
    """No CI variable of this machine's own (the project's CI may itself be a split job)."""
    for name in EVERY_VARIABLE:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _set(monkeypatch, variables: dict) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


class TestDetection:
    @pytest.mark.parametrize("system", CI_VARIABLES)
    @pytest.mark.parametrize("index", range(4))
    def test_each_system_names_the_shard_of_the_explicit_form(self, ci_env, system, index):
        _set(ci_env, CI_VARIABLES[system](index, 4))
        source = sharding.shard_from_environment()
        assert source.system.name == system and source.shard == f"{index}/4"
        assert ConformanceRun._shard(source.shard) == (index, 4)  # what --shard=I/N parses it to

    def test_it_says_what_it_found_and_records_it(self, ci_env):
        _set(ci_env, {"CI_NODE_INDEX": "2", "CI_NODE_TOTAL": "4"})
        source = sharding.shard_from_environment()
        assert source.announcement() == "--shard=auto: GitLab CI (CI_NODE_INDEX=2 of CI_NODE_TOTAL=4) → shard 1/4"
        assert source.record() == {
            "given": "--shard=auto", "system": "GitLab CI", "variables": {"CI_NODE_INDEX": "2", "CI_NODE_TOTAL": "4"},
        }  # fmt: skip

    def test_none_found_is_an_error_naming_every_variable_looked_for(self, ci_env):
        with pytest.raises(sharding.ShardDetectionError) as caught:
            sharding.shard_from_environment()
        message = str(caught.value)
        assert "found no CI job index" in message and all(name in message for name in EVERY_VARIABLE)
        assert "--shard=${{ matrix.shard }}/N" in message and "--shard=I/N" in message

    def test_a_gitlab_job_without_parallel_is_not_a_split_job(self, ci_env):
        ci_env.setenv("CI_NODE_TOTAL", "1")  # what GitLab sets in a job without `parallel:`
        with pytest.raises(sharding.ShardDetectionError, match="CI_NODE_TOTAL=1 is set without CI_NODE_INDEX"):
            sharding.shard_from_environment()
        _set(ci_env, CI_VARIABLES["Buildkite"](2, 3))  # nor does that lone total stand in another system's way
        assert sharding.shard_from_environment().shard == "2/3"

    def test_a_job_with_no_parallelism_is_the_single_shard(self, ci_env):
        _set(ci_env, CI_VARIABLES["CircleCI"](0, 1))
        source = sharding.shard_from_environment()
        assert source.shard == "0/1" and source.announcement().endswith("→ shard 0/1")

    @pytest.mark.parametrize(
        ("first", "second"),
        [(("GitLab CI", 0, 2), ("Buildkite", 1, 2)), (("CircleCI", 0, 2), ("Kubernetes Indexed Job", 0, 3))],
        ids=["other-index", "other-count"],
    )
    def test_systems_that_disagree_are_an_error_naming_both(self, ci_env, first, second):
        variables = {**CI_VARIABLES[first[0]](*first[1:]), **CI_VARIABLES[second[0]](*second[1:])}
        _set(ci_env, variables)
        with pytest.raises(sharding.ShardDetectionError) as caught:
            sharding.shard_from_environment()
        message = str(caught.value)
        assert "disagree" in message and first[0] in message and second[0] in message
        assert all(f"{name}={value}" in message for name, value in variables.items())
        assert "unset the variables" in message and "--shard=I/N" in message

    def test_systems_that_agree_are_one_shard(self, ci_env):
        _set(ci_env, {**CI_VARIABLES["GitLab CI"](1, 2), **CI_VARIABLES["CircleCI"](1, 2)})
        source = sharding.shard_from_environment()
        assert source.shard == "1/2" and source.system.name == "GitLab CI"

    @pytest.mark.parametrize(
        ("variables", "fragments"),
        [
            ({"CI_NODE_INDEX": "two", "CI_NODE_TOTAL": "4"}, ["CI_NODE_INDEX='two'", "not a whole number", "parallel: N"]),
            ({"CI_NODE_INDEX": "0", "CI_NODE_TOTAL": "4"}, ["CI_NODE_INDEX=0", "out of range", "from 1 to CI_NODE_TOTAL"]),
            ({"CI_NODE_INDEX": "5", "CI_NODE_TOTAL": "4"}, ["CI_NODE_INDEX=5", "CI_NODE_TOTAL=4", "out of range"]),
            ({"BUILDKITE_PARALLEL_JOB": "3", "BUILDKITE_PARALLEL_JOB_COUNT": "3"},
             ["BUILDKITE_PARALLEL_JOB=3", "from 0 to BUILDKITE_PARALLEL_JOB_COUNT - 1"]),
            ({"BUILDKITE_PARALLEL_JOB": "1"}, ["BUILDKITE_PARALLEL_JOB=1 is set", "BUILDKITE_PARALLEL_JOB_COUNT is not"]),
            ({"CIRCLE_NODE_INDEX": "-1", "CIRCLE_NODE_TOTAL": "2"}, ["CIRCLE_NODE_INDEX='-1'", "not a whole number"]),
            ({"CIRCLE_NODE_INDEX": "0", "CIRCLE_NODE_TOTAL": "0"}, ["CIRCLE_NODE_TOTAL=0", "at least 1"]),
            ({"JOB_COMPLETION_INDEX": "1"}, ["LORA_CONFORMANCE_JOB_COMPLETIONS is not", "spec.completions", "env"]),
            ({"JOB_COMPLETION_INDEX": "1", "LORA_CONFORMANCE_JOB_COMPLETIONS": ""},
             ["LORA_CONFORMANCE_JOB_COMPLETIONS=''", "not a whole number"]),
            # a malformed system is an error even beside one that is well formed
            ({"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "2", "CIRCLE_NODE_INDEX": "x", "CIRCLE_NODE_TOTAL": "2"},
             ["CIRCLE_NODE_INDEX='x'"]),
        ],
        ids=["word", "gitlab-zero", "past-total", "past-count", "no-count", "negative", "zero-count", "k8s-no-count",
             "k8s-empty-count", "one-malformed"],
    )  # fmt: skip
    def test_malformed_values_are_an_error_naming_the_variable_and_the_fix(self, ci_env, variables, fragments):
        _set(ci_env, variables)
        with pytest.raises(sharding.ShardDetectionError) as caught:
            sharding.shard_from_environment()
        message = str(caught.value)
        assert all(fragment in message for fragment in fragments), message
        assert "--shard=I/N" in message


# -- the command line -------------------------------------------------------------------------------

SELECTION = ("-m", "not e2e", "-k", "bgmv_shrink")  # about 50 smoke cases: a few seconds a run
SHARDS = 2


def conformance(*args: str, report_dir: Path, variables: dict | None = None, command: tuple = ()) -> subprocess.CompletedProcess:
    """tests/test_cli.py's run, in an environment holding only ``variables`` of the CI ones."""
    env = {name: value for name, value in os.environ.items() if name not in EVERY_VARIABLE}
    env.update(variables or {})
    command = command or (sys.executable, "-m", "pytest", "conformance")
    full = [*command, "-q", "-p", "no:cacheprovider", "--target=reference", "--profile=smoke", "--report-dir", str(report_dir), *args]
    return subprocess.run(full, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def merge(shard_files: list[Path], out: Path) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, "-m", "conformance.report", "merge", *map(str, shard_files), "--out", str(out)]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return completed, results(out)


def announcement(system: str, index: int, count: int) -> str:
    variables = CI_VARIABLES[system](index, count)
    index_name, count_name = variables  # each system's index first
    return f"--shard=auto: {system} ({index_name}={variables[index_name]} of {count_name}={variables[count_name]}) → shard {index}/{count}"


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> dict:
    report_dir = tmp_path_factory.mktemp("unsharded")
    completed = conformance(*SELECTION, report_dir=report_dir)
    assert completed.returncode == 0, completed.stdout[-2000:]
    return results(report_dir)


@pytest.fixture(scope="module")
def explicit(tmp_path_factory) -> list[dict]:
    """The manifests of ``--shard=I/N`` for every I, the selection run."""
    manifests = []
    for index in range(SHARDS):
        report_dir = tmp_path_factory.mktemp(f"explicit-{index}")
        completed = conformance(f"--shard={index}/{SHARDS}", *SELECTION, report_dir=report_dir)
        assert completed.returncode == 0, completed.stdout[-2000:]
        manifests.append(json.loads((report_dir / "run.json").read_text()))
        assert manifests[-1]["shard_source"] == {"given": f"--shard={index}/{SHARDS}"}
    return manifests


@pytest.mark.parametrize("system", CI_VARIABLES)
def test_auto_shards_are_the_explicit_ones_and_merge_into_the_unsharded_run(system, explicit, unsharded, tmp_path):
    shard_files = []
    for index in range(SHARDS):
        report_dir, variables = tmp_path / f"shard-{index}", CI_VARIABLES[system](index, SHARDS)
        completed = conformance("--shard=auto", *SELECTION, report_dir=report_dir, variables=variables)
        assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
        assert announcement(system, index, SHARDS) in completed.stdout  # in the verdict section, even with -q
        manifest = json.loads((report_dir / "run.json").read_text())
        assert manifest["shard"] == f"{index}/{SHARDS}"
        assert manifest["expected"] == explicit[index]["expected"] and manifest["shard_cases"] == explicit[index]["shard_cases"]
        assert manifest["shard_source"] == results(report_dir)["shard_source"] == {
            "given": "--shard=auto", "system": system, "variables": variables,
        }  # fmt: skip
        shard_files.append(report_dir / "results.json")

    completed, merged = merge(shard_files, tmp_path / "merged")
    assert [r["id"] for r in merged["results"]] == [r["id"] for r in unsharded["results"]]
    assert merged["duplicated"] == [] and merged["unexpected"] == []
    # the shards hold the whole profile and the runs judged the selection, so the merge (exit 1) names
    # exactly the cases the selection left out, and nothing else: no shard absent, none twice
    left_out = set(merged["shard_cases"]) - {r["id"] for r in unsharded["results"]}
    assert completed.returncode == 1 and set(merged["missing"]) == left_out
    assert case_list_summary(merged["shard_cases"]) == unsharded["case_list"]
    assert not any("missing from the merge" in reason for reason in merged["gate"]["reasons"])


def test_auto_shards_of_the_whole_profile_merge_into_a_passing_verdict(unsharded, tmp_path):
    """The Kubernetes Indexed Job of examples/ci/kubernetes-indexed-job.yaml, through the console script: the merge exits 0."""
    script = (str(Path(sys.executable).parent / "lora-conformance"), "run")
    shard_files = []
    for index in range(SHARDS):
        report_dir = tmp_path / f"shard-{index}"
        variables = CI_VARIABLES["Kubernetes Indexed Job"](index, SHARDS)
        completed = conformance("--shard=auto", report_dir=report_dir, variables=variables, command=script)
        assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
        assert announcement("Kubernetes Indexed Job", index, SHARDS) in completed.stdout
        shard_files.append(report_dir / "results.json")
    completed, merged = merge(shard_files, tmp_path / "merged")
    assert completed.returncode == 0 and completed.stdout.startswith("verdict: PASS"), completed.stdout + completed.stderr
    # every case of the profile the unsharded run drew, each once
    assert case_list_summary([r["id"] for r in merged["results"]]) == unsharded["case_list"]
    assert merged["missing"] == [] and merged["duplicated"] == []


def test_resume_of_an_auto_shard_keeps_its_shard(tmp_path):
    variables = CI_VARIABLES["GitLab CI"](1, SHARDS)
    assert conformance("--shard=auto", *SELECTION, report_dir=tmp_path, variables=variables).returncode == 0
    first = results(tmp_path)
    # the run as a kill would have left it: ten results journalled, no results.json
    journal = tmp_path / "results" / "main.jsonl"
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:10]))
    (tmp_path / "results.json").unlink()

    resume = ("--resume", str(tmp_path))
    resumed = conformance("--shard=auto", *resume, report_dir=tmp_path, variables=variables)  # the job retried
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"{len(first['expected']) - 10} passed" in resumed.stdout
    document = results(tmp_path)
    assert document["shard"] == f"1/{SHARDS}" and document["shard_source"] == first["shard_source"]
    assert document["missing"] == [] and document["gate"]["passed"] and len(document["results"]) == len(first["results"])

    # another copy's variables contradict the run's recorded shard
    other = conformance("--shard=auto", *resume, report_dir=tmp_path, variables=CI_VARIABLES["GitLab CI"](0, SHARDS))
    assert other.returncode == 4
    [line] = error_lines(other)
    assert f"has --shard=1/{SHARDS}, not 0/{SHARDS}" in line


def test_auto_without_any_ci_variable_is_a_usage_error(tmp_path):
    completed = conformance("--shard=auto", report_dir=tmp_path)
    assert completed.returncode == 4  # pytest's usage error, before anything runs
    [line] = error_lines(completed)
    assert "--shard=auto found no CI job index" in line and all(name in line for name in EVERY_VARIABLE)
    assert not (tmp_path / "run.json").exists()
