"""The CI recipes in examples/ci/ are what a CI system and the suite accept.

Each file is loaded as YAML and given the structure its system needs; every command in it that
invokes the suite is parsed with the suite's own command line (``suite_commands``), and the shards
the recipe starts are checked to be exactly the N shards of one case list, all of them merged.
The commands in the README and the docs' code blocks are parsed the same way.
"""

from __future__ import annotations

import itertools
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from suite_commands import STANDARD_PYTEST_OPTIONS, CommandRefused, check, pytest_parser, suite_commands

from conformance import sharding
from conformance.options_doc import plugin_options
from conformance.session import ConformanceRun

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "examples" / "ci"
GITLAB_KEYWORDS = {"stages", "variables", "default", "include", "workflow", "image", "services", "cache", "before_script", "after_script"}
MATRIX_EXPRESSION = re.compile(r"\$\{\{\s*matrix\.(\w+)\s*\}\}")


def load(name: str) -> dict:
    return yaml.safe_load((CI / name).read_text())


def checked(script: str) -> list[tuple[str, object]]:
    """``(program, parsed arguments)`` of every suite command in ``script``; a refused one fails the test."""
    commands = []
    for program, arguments in suite_commands(script):
        try:
            commands.append((program, check(program, arguments)))
        except CommandRefused as exc:
            pytest.fail(f"{program} {' '.join(arguments)}\n  refused: {exc}")
    return commands


def runs(commands) -> list:
    return [args for _, args in commands if hasattr(args, "target")]


def merges(commands) -> list:
    return [args for _, args in commands if getattr(args, "command", None) == "merge"]


def expand_shell(text: str, variable: str, value) -> str:
    return text.replace(f"${{{variable}}}", str(value)).replace(f"${variable}", str(value))


def shard_index(shard: str, environ: dict[str, str] | None = None) -> tuple[int, int]:
    """What a run makes of its --shard: I/N as given, or auto from a CI system's variables."""
    if shard == sharding.AUTO:
        shard = sharding.shard_from_environment(environ or {}).shard
    return ConformanceRun._shard(shard)


def assert_merged_whole(shards: list[tuple[int, int]], report_dirs: list[str], merge) -> None:
    """N shards of one case list, each once, each in a report dir of its own that the merge reads."""
    [count] = {count for _, count in shards}
    assert sorted(index for index, _ in shards) == list(range(count)), f"the shards are not 0/{count} … {count - 1}/{count}: {shards}"
    assert len(set(report_dirs)) == len(report_dirs), f"shards share a report dir: {report_dirs}"
    for report_dir in report_dirs:
        results = f"{report_dir.rstrip('/')}/results.json"
        assert any(fnmatch(results, pattern) for pattern in merge.results), f"the merge ({merge.results}) does not read {results}"
    assert not any(fnmatch(f"{merge.out}/results.json", pattern) for pattern in merge.results), "the merge reads its own output"


# --- the checker itself --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script",
    [
        "pytest conformance --target=hpu --profle=release",  # misspelt option
        "lora-conformance run --target=hpu --shard-auto",  # misspelt option
        "pytest conformance --target=hpu --profile=relase",  # not one of the profiles
        "pytest conformance --target=hpu --seed=one",  # not a number
        "pytest conformance --target=hpu --rep=2",  # an abbreviation, which pytest refuses
        "lora-conformance report merge a/results.json --outdir merged",  # misspelt option
        "python -m conformance.report merge a/results.json",  # --out is required
        "lora-conformance report mrege a/results.json --out merged",  # no such subcommand
        "lora-conformance rnu --target=hpu",  # no such command
    ],
)
def test_the_checker_refuses_what_the_suite_refuses(script):
    [(program, arguments)] = suite_commands(script)
    with pytest.raises(CommandRefused):
        check(program, arguments)


def test_the_checker_finds_every_suite_command_and_only_those():
    script = (
        "bash scripts/install-cpu-env .venv && .venv/bin/python -m pytest conformance --target=hpu-emulated -n 2\n"
        "CUDA_VISIBLE_DEVICES=0 lora-conformance run --target=cuda --profile=smoke || test $? -eq 1\n"
        ".venv/bin/python -m pytest tests -n 2; python -m conformance.report merge s-*/results.json --out merged\n"
        "kubectl apply -f job.yaml | tee log\n"
    )
    found = suite_commands(script)
    assert [program for program, _ in found] == ["pytest", "lora-conformance", "conformance.report"]
    parsed = [check(program, arguments) for program, arguments in found]
    assert parsed[0].target == "hpu-emulated" and parsed[0].numprocesses == "2"
    assert parsed[1].profile == "smoke" and parsed[1].pyargs
    assert parsed[2].results == ["s-*/results.json"] and parsed[2].out == "merged"


def test_the_checker_knows_every_plugin_option_and_pytest_knows_the_standard_ones(pytestconfig):
    parser = pytest_parser()
    known = {name for action in parser._actions for name in action.option_strings}
    assert {name for option in plugin_options() for name in option.names} <= known
    for names in STANDARD_PYTEST_OPTIONS:
        for name in names:
            pytestconfig.getoption(name)  # ValueError if this pytest (with xdist, allure) has no such option


# --- GitHub Actions ------------------------------------------------------------------------------


def matrix_runs(job: dict) -> list[dict]:
    """Each combination of the job's matrix (one empty one without a matrix)."""
    matrix = job.get("strategy", {}).get("matrix", {})
    keys = sorted(matrix)
    return [dict(zip(keys, values)) for values in itertools.product(*(matrix[key] for key in keys))]


def rendered(text: str, values: dict) -> str:
    text = MATRIX_EXPRESSION.sub(lambda match: str(values[match.group(1)]), text)
    assert "${{" not in text, f"an expression this test cannot evaluate: {text}"
    return text


def test_github_actions_workflow():
    workflow = load("github-actions.yml")
    assert workflow.get("on", workflow.get(True)), "no trigger"  # YAML 1.1 reads the key `on` as true
    jobs = workflow["jobs"]
    commands = {}
    for name, job in jobs.items():
        assert job["runs-on"] and job["steps"], name
        assert all("run" in step or "uses" in step for step in job["steps"]), name
        commands[name] = [
            (values, checked(rendered(step["run"], values))) for values in matrix_runs(job) for step in job["steps"] if "run" in step
        ]
    shards, report_dirs = [], []
    for values, parsed in commands["conformance"]:
        [run] = runs(parsed)
        shards.append(shard_index(run.shard))
        report_dirs.append(f"shards/shard-{values['shard']}")  # where the merge job downloads its artifact
        assert run.report_dir == f"reports/shard-{values['shard']}"
    [(_, parsed)] = commands["merge"]
    [merge] = merges(parsed)
    assert jobs["conformance"]["strategy"]["fail-fast"] is False, "a failing shard would cancel the others"
    assert jobs["merge"]["needs"] == "conformance" and jobs["merge"]["if"] == "always()"
    assert_merged_whole(shards, report_dirs, merge)


# --- GitLab CI -----------------------------------------------------------------------------------


def test_gitlab_ci_jobs():
    pipeline = load("gitlab-ci.yml")
    jobs = {name: job for name, job in pipeline.items() if name not in GITLAB_KEYWORDS and not name.startswith(".")}
    assert jobs, "no job"
    for name, job in jobs.items():
        assert job["script"] and job["stage"] in pipeline["stages"], name
    shard_job = jobs["conformance"]
    count = shard_job["parallel"]
    assert isinstance(count, int), "`parallel: N`, not `parallel: matrix:` (docs/scale-out.md)"
    [run] = runs(checked("\n".join(shard_job["script"])))
    assert run.shard == sharding.AUTO
    shards = [shard_index(run.shard, {"CI_NODE_INDEX": str(node), "CI_NODE_TOTAL": str(count)}) for node in range(1, count + 1)]
    report_dirs = [expand_shell(run.report_dir, "CI_NODE_INDEX", node) for node in range(1, count + 1)]
    merge_job = jobs["merge"]
    [merge] = merges(checked("\n".join(merge_job["script"])))
    assert merge_job["needs"] == ["conformance"] and merge_job["when"] == "always"
    assert_merged_whole(shards, report_dirs, merge)


# --- Kubernetes ----------------------------------------------------------------------------------


def container_script(job: dict) -> tuple[dict, str]:
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/bash", "-c"], "the args are one shell script"
    [script] = container["args"]
    return container, script


def claim(job: dict) -> str:
    [volume] = job["spec"]["template"]["spec"]["volumes"]
    return volume["persistentVolumeClaim"]["claimName"]


def test_kubernetes_indexed_job_and_its_merge():
    job, merge_job = load("kubernetes-indexed-job.yaml"), load("kubernetes-merge-job.yaml")
    for manifest in (job, merge_job):
        assert manifest["apiVersion"] == "batch/v1" and manifest["kind"] == "Job"
        assert manifest["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    count = spec["completions"]
    assert isinstance(count, int) and 1 <= spec["parallelism"] <= count
    container, script = container_script(job)
    environ = {variable["name"]: variable["value"] for variable in container["env"]}
    assert environ[sharding.K8S_COMPLETIONS] == str(count), "the shard count the pods read is not spec.completions"
    [run] = runs(checked(script))
    shards = [shard_index(run.shard, {"JOB_COMPLETION_INDEX": str(index), **environ}) for index in range(count)]
    report_dirs = [expand_shell(run.report_dir, "JOB_COMPLETION_INDEX", index) for index in range(count)]

    assert "completionMode" not in merge_job["spec"] and merge_job["spec"]["backoffLimit"] == 0, "a failed gate is not retried"
    merge_container, merge_script = container_script(merge_job)
    assert "resources" not in merge_container, "the merge needs no device"
    assert claim(merge_job) == claim(job), "the merge reads another volume than the shards write"
    [merge] = merges(checked(merge_script))
    assert_merged_whole(shards, report_dirs, merge)


# --- commands in the docs ------------------------------------------------------------------------

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
DOCS_WITH_COMMANDS = ["README.md", "docs/scale-out.md"]


@pytest.mark.parametrize("name", DOCS_WITH_COMMANDS)
def test_the_commands_in_the_docs_parse(name):
    blocks = FENCE.findall((ROOT / name).read_text())
    assert checked("\n".join(blocks)), f"{name} shows no suite command"
