"""``scripts/device-kit``: its refusals, the run script it writes into a kit, and a real (small) hpu kit.

A cuda kit is several GB (docs/hardware.md has its rehearsal, measured by hand): CI builds none. What is
tested here is what a lab would otherwise find out hours into a run: a bad stack or vLLM version refused
with the fix; the run script's commands (``run.sh --dry-run``) parsed with the suite's real command line;
its install from the wheelhouse only; and an hpu kit (tens of MB, no torch) built from the registry.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs.suite_commands import check, suite_commands
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conformance import selfcheck

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device-kit"


def _load_kit():
    loader = importlib.machinery.SourceFileLoader("device_kit", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("device_kit", loader))
    loader.exec_module(module)
    return module


kit_script = _load_kit()


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["rocm", "--out", "/tmp/k"], "unknown stack 'rocm': the stacks are cuda, hpu"),
        (["cuda", "--vllm", "0.32.0", "--out", "/tmp/k"], "use --vllm 0.33.0 or --vllm 0.34.0"),
        (["cuda", "--vllm", "latest", "--out", "/tmp/k"], "vLLM latest is not a release this kit is made for"),
        (["hpu", "--vllm", "0.33.0", "--out", "/tmp/k"], "the hpu stack takes no --vllm"),
        (["cuda", "--out", str(ROOT / "kits")], "is inside the checkout"),
    ],
)
def test_bad_input_is_refused_naming_the_fix(argv, message):
    with pytest.raises(kit_script.KitError, match=message.replace("(", r"\(")):
        kit_script.parse_args(argv)


def test_cuda_defaults_to_vllm_0_33_and_hpu_takes_none():
    assert kit_script.parse_args(["cuda", "--out", "/tmp/k"]).vllm == "0.33.0"
    assert kit_script.parse_args(["hpu", "--out", "/tmp/k"]).vllm is None


@pytest.mark.integration
def test_the_command_exits_2_with_the_message_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "cuda", "--vllm", "0.30.0", "--out", str(tmp_path / "kit")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: vLLM 0.30.0 is not a release") and "--vllm 0.33.0 or --vllm 0.34.0" in done.stderr
    assert not (tmp_path / "kit").exists()


# -- the hpu closure: the suite's dependencies less torch and what only torch needs --------------------------------


def _item(name, version, *requires):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


def test_the_hpu_closure_leaves_out_torch_and_what_only_torch_needs():
    report = {"install": [
        _item("lora-conformance", "0.1.0", "torch", "numpy", "peft; extra == 'e2e'", "allure-pytest; extra == 'reports'", "ruff; extra == 'dev'"),
        _item("torch", "2.14.0", "sympy", "filelock", "nvidia-cublas; platform_system == 'Linux'"),
        _item("sympy", "1.14"), _item("nvidia-cublas", "13.1"), _item("filelock", "4.3"), _item("numpy", "2.3.5"),
        _item("peft", "0.21.2", "torch>=1.13", "accelerate", "transformers"),
        _item("accelerate", "1.16.0", "torch>=2.0", "psutil"), _item("psutil", "7.2"),
        _item("transformers", "5.20.2", "filelock", "tokenizers"), _item("tokenizers", "0.23.3"),
        _item("allure-pytest", "2.16.2"), _item("pytest-xdist", "3.8.0", "execnet"), _item("execnet", "2.1"),
        _item("ruff", "0.17.6"),
    ]}
    closure = kit_script.closure_without(report, [("lora_conformance", {"e2e", "reports"}), ("pytest-xdist", set())], {"torch"})
    assert set(closure) == {"lora-conformance", "numpy", "peft", "accelerate", "psutil", "transformers", "filelock", "tokenizers",
                            "allure-pytest", "pytest-xdist", "execnet"}  # filelock stays: transformers needs it too
    assert closure["peft"] == "0.21.2"


@pytest.mark.integration
def test_the_kit_names_the_commit_and_says_when_the_checkout_differs_from_it(tmp_path):
    """The suite's wheel is built from the working tree: a kit made from a checkout with changed or new files
    must not claim the bare commit (a lab's report would then name code it never ran)."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert kit_script.git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "b.py").write_text("")
    assert kit_script.git_commit(tmp_path) == f"{head} + uncommitted changes in 2 files"


# -- the run script ---------------------------------------------------------------------------------------------


def _kit(tmp_path: Path, stack: str) -> Path:
    """A kit directory with the run script and kit.json device-kit writes (an empty wheelhouse: dry runs only)."""
    kit = {"stack": stack, "target": kit_script.STACKS[stack], "suite": "0.1.0", "commit": "abc1234", "python": "3.11",
           "platform": "linux-x86_64", "built": "2026-12-06T07:27:04Z",
           **({"vllm": "0.34.0", "torch": "2.14.0"} if stack == "cuda" else {"excluded": ["torch"]}),
           "requirements": [*(["vllm==0.34.0", "torch==2.14.0"] if stack == "cuda" else []), "lora-conformance[e2e,reports]==0.1.0", "pytest-xdist"],
           "wheels": {}}
    directory = tmp_path / f"kit {stack}"  # a blank in the path: the script quotes what it runs
    (directory / "wheelhouse").mkdir(parents=True)
    (directory / "kit.json").write_text(json.dumps(kit))
    (directory / "run.sh").write_text(kit_script.run_script(kit))
    return directory


def _dry_run(kit: Path, *options: str) -> list[str]:
    done = subprocess.run(["bash", str(kit / "run.sh"), "--dry-run", *options], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "REPORT": "/lab/report"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.integration
@pytest.mark.parametrize("stack", ["cuda", "hpu"])
def test_the_run_scripts_suite_commands_parse_with_the_real_command_line(tmp_path, stack):
    target = kit_script.STACKS[stack]
    lines = _dry_run(_kit(tmp_path, stack), "--devices=auto")
    commands = suite_commands("\n".join(lines))
    assert [arguments[0] for _, arguments in commands] == ["self-check", "run", "run", "run"]
    assert commands[0][1] == ["self-check", f"--target={target}"]
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        selfcheck.main(["--help"])
    assert "--target" in help_text.getvalue()
    smoke, e2e, tp = (check(program, arguments) for program, arguments in commands[1:])
    assert smoke.target == e2e.target == tp.target == target and smoke.devices == e2e.devices == tp.devices == "auto"
    assert smoke.profile == "smoke" and smoke.numprocesses == str(kit_script.WORKERS[stack]) and smoke.m is None
    assert (e2e.m, tp.m) == ("e2e", "tp") and e2e.profile is None and tp.profile is None  # the standard profile's levels
    assert [run.report_dir for run in (smoke, e2e, tp)] == ["/lab/report/smoke", "/lab/report/e2e", "/lab/report/tp"]


@pytest.mark.integration
def test_the_cuda_run_script_installs_the_pinned_stack_from_the_wheelhouse_only(tmp_path):
    kit = _kit(tmp_path, "cuda")
    lines = _dry_run(kit)
    [install] = [line for line in lines if " -m pip install " in line and "--no-deps" not in line]
    wheelhouse = str(kit / "wheelhouse").replace(" ", "\\ ")
    assert f"-m pip install --no-index --find-links {wheelhouse} vllm==0.34.0 torch==2.14.0 lora-conformance\\[e2e\\,reports\\]==0.1.0 pytest-xdist" in install
    assert lines[0] == f"python3 -m venv {str(kit / 'venv').replace(' ', chr(92) + ' ')}"  # a venv of its own: the CUDA torch comes from the kit
    assert not any("habana" in line for line in lines)


@pytest.mark.integration
def test_the_hpu_run_script_uses_the_images_torch_and_installs_none(tmp_path):
    lines = _dry_run(_kit(tmp_path, "hpu"))
    assert lines[0].startswith("python3 -m venv --system-site-packages ")
    words = [shlex.split(line) for line in lines]
    assert "import torch, habana_frameworks.torch" in words[1][-1]  # checked before anything is installed
    installs = [line for line in lines if " -m pip install " in line]
    assert installs and all("--no-index" in line for line in installs) and not any("torch==" in line for line in installs)
    assert any("torch.__file__.startswith(sys.prefix)" in command[-1] for command in words)  # the image's torch is still the one


@pytest.mark.integration
def test_the_run_script_refuses_another_python_before_touching_anything(tmp_path):
    kit = _kit(tmp_path, "cuda")
    json_kit = json.loads((kit / "kit.json").read_text())
    json_kit["python"] = "3.99"
    (kit / "run.sh").write_text(kit_script.run_script(json_kit))
    done = subprocess.run(["bash", str(kit / "run.sh")], capture_output=True, text=True, timeout=60, env={**os.environ, "REPORT": str(tmp_path / "r")})
    assert done.returncode == 2 and "the kit's wheels are for Python 3.99" in done.stderr and "PYTHON=python3.99" in done.stderr
    assert not (tmp_path / "r").exists() and not (kit / "venv").exists()


# -- a real hpu kit ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_hpu_kit_holds_the_suite_and_its_dependencies_and_no_torch(tmp_path):
    """From the registry (about 60 MB, no torch): the wheelhouse holds the suite's wheel and every package its run
    needs but torch, each requirement met, so pip --no-index finds everything beside the image's torch."""
    out = tmp_path / "hpu-kit"
    done = subprocess.run([sys.executable, str(SCRIPT), "hpu", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kit = json.loads((out / "kit.json").read_text())
    names = {wheel.split("-")[0].lower() for wheel in kit["wheels"]}
    assert {"lora_conformance", "numpy", "peft", "transformers", "tokenizers", "allure_pytest", "pytest_xdist", "hypothesis"} <= names
    assert not names & {"torch", "triton", "sympy"} and not any(name.startswith("nvidia") for name in names)
    assert kit["requirements"] == ["lora-conformance[e2e,reports]==0.1.0", "pytest-xdist"] and kit["excluded"] == ["torch"]
    assert_closed(out / "wheelhouse", [("lora-conformance", {"e2e", "reports"}), ("pytest-xdist", set())], excluded={"torch"})


def assert_closed(wheelhouse: Path, roots, excluded: set[str]) -> None:
    """Every requirement reachable from ``roots`` (markers evaluated here, extras followed) is met by a wheel of
    ``wheelhouse`` but those in ``excluded``: what pip --no-index will need on the lab machine is there."""
    wheels = {}
    for wheel in wheelhouse.glob("*.whl"):
        metadata = kit_script.wheel_metadata(wheel)
        name = re.search(r"^Name: (.+)$", metadata, re.MULTILINE).group(1).strip()
        wheels[canonicalize_name(name)] = (Version(re.search(r"^Version: (.+)$", metadata, re.MULTILINE).group(1).strip()),
                                           re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE))
    queue, seen = list(roots), set()
    while queue:
        name, extras = queue.pop()
        name = canonicalize_name(name)
        if name in excluded or (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        assert name in wheels, f"{name} is needed and not in the wheelhouse"
        for text in wheels[name][1]:
            requirement = Requirement(text)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in {"", *extras}):
                needed = canonicalize_name(requirement.name)
                if needed not in excluded:
                    assert needed in wheels and wheels[needed][0] in requirement.specifier, f"{name} needs {text}: not met by the wheelhouse"
                queue.append((needed, set(requirement.extras)))
