"""Another vLLM release's CPU LoRA ops on the ``cpu`` target: ``scripts/vllm-cpu-ops-from-wheel`` and
``LORA_CONFORMANCE_VLLM_CPU_OPS`` (``conformance.targets._vllm``: ``read_cpu_ops``, ``swap_cpu_ops``).

No network: the "wheel" is built here from the installed vllm-cpu's own files, with a METADATA that
claims another version and, for the swap checks, a ``lora_ops.py`` that counts its calls, so that the
run can tell the swapped ops from the installed ones.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from conformance.expectations import load_expectations, shipped_expectations, split_applicable, version_lookup
from conformance.report.fingerprint import environment_fingerprint
from conformance.runner import run_case
from conformance.session import ConformanceRun, RunSettings
from conformance.targets import TargetUnavailable
from conformance.targets._vllm import (
    CPU_OPS_ENV,
    CPU_PATH_NOT_SWAPPABLE,
    PUNICA_CPU,
    TORCH_OPS_DIR,
    CpuOpsError,
    installed_vllm_file,
    installed_vllm_version,
    read_cpu_ops,
    restore_installed_cpu_ops,
)
from conformance.targets.describe import probe_case
from conformance.targets.facts import facts_of, probe

vllm_cpu = pytest.importorskip("conformance.targets.vllm_cpu")
pytest.importorskip("vllm.lora.ops.torch_ops")
VllmCpuTarget = vllm_cpu.VllmCpuTarget

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "vllm-cpu-ops-from-wheel"
LORA_OPS = f"{TORCH_OPS_DIR}/lora_ops.py"
WHEEL_FILES = (f"{TORCH_OPS_DIR}/__init__.py", LORA_OPS, PUNICA_CPU, *CPU_PATH_NOT_SWAPPABLE)
# appended to the copied lora_ops.py: every bgmv_shrink call (sgmv_shrink calls it too) is counted
COUNTING = b'''

CALLS = []
_uncounted_bgmv_shrink = bgmv_shrink


def bgmv_shrink(*args, **kwargs):
    CALLS.append("bgmv_shrink")
    return _uncounted_bgmv_shrink(*args, **kwargs)
'''
MINUS_ONE_ENTRIES = {
    "vllm-cpu-no-adapter-rows", "vllm-cpu-no-adapter-rows-mixed-batch", "vllm-cpu-no-adapter-rows-decode",
    "vllm-cpu-no-adapter-rows-logits", "vllm-cpu-no-adapter-requests-e2e", "vllm-cpu-no-adapter-rows-tp",
    "vllm-cpu-no-adapter-rows-tp-decode",
}
STILL_IN_033 = {"vllm-cpu-add-lora-linear-add-inputs", "vllm-cpu-sgmv-ignores-seq-start-loc"}


def _script():
    loader = importlib.machinery.SourceFileLoader("vllm_cpu_ops_from_wheel", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def fake_wheel(where: Path, version: str, changes: dict[str, bytes] | None = None, bad_record: str | None = None) -> Path:
    """A "vllm" wheel of the installed files (changed as given), with METADATA saying ``version``."""
    changes = changes or {}
    files = {path: changes.get(path, installed_vllm_file(path).read_bytes()) for path in WHEEL_FILES}
    dist_info = f"vllm-{version}.dist-info"
    files[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n".encode()

    def digest(path: str, data: bytes) -> str:
        data = b"not the file" if path == bad_record else data
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},{digest(path, data)},{len(data)}\n" for path, data in files.items()) + f"{dist_info}/RECORD,,\n"
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{dist_info}/RECORD", record)
    return wheel


def build(where: Path, version: str, **wheel_options) -> tuple[int, Path]:
    directory = where / f"ops-{version}"
    wheel = fake_wheel(where / "wheel", version, **wheel_options)
    return _script().main([version, str(directory), "--wheel", str(wheel)]), directory


@pytest.fixture(scope="module")
def ops_033(tmp_path_factory) -> Path:
    """What the script extracts from a "0.33.0" wheel whose lora_ops.py counts its calls."""
    counting = installed_vllm_file(LORA_OPS).read_bytes() + COUNTING
    status, directory = build(tmp_path_factory.mktemp("swap"), "0.33.0", changes={LORA_OPS: counting})
    assert status == 0
    return directory


@pytest.fixture
def swapped(monkeypatch):
    """Runs the test with LORA_CONFORMANCE_VLLM_CPU_OPS set by it, and puts the installed ops back after."""
    yield monkeypatch
    monkeypatch.delenv(CPU_OPS_ENV, raising=False)
    restore_installed_cpu_ops()
    VllmCpuTarget.check_available()


def test_the_script_extracts_the_torch_ops_and_records_what_it_shares_with_the_installed_vllm(ops_033):
    manifest = json.loads((ops_033 / "manifest.json").read_text())
    assert manifest["vllm_version"] == "0.33.0" and manifest["compared_with_installed"] == installed_vllm_version()
    assert sorted(manifest["files"]) == [f"{TORCH_OPS_DIR}/__init__.py", LORA_OPS]
    assert sorted(manifest["same_as_installed"]) == sorted([PUNICA_CPU, *CPU_PATH_NOT_SWAPPABLE])
    assert (ops_033 / LORA_OPS).read_bytes().endswith(COUNTING)
    assert read_cpu_ops(ops_033).vllm_version == "0.33.0"


def test_the_script_refuses_a_release_that_changed_the_wrappers_base_or_a_damaged_wheel(tmp_path, capsys):
    base = CPU_PATH_NOT_SWAPPABLE[0]
    status, _ = build(tmp_path / "base", "0.34.0", changes={base: installed_vllm_file(base).read_bytes() + b"\n# changed\n"})
    assert status == 1 and f"{base} differs from the installed" in capsys.readouterr().err
    status, _ = build(tmp_path / "record", "0.34.0", bad_record=LORA_OPS)
    assert status == 1 and f"{LORA_OPS} does not match its sha256 in the wheel's RECORD" in capsys.readouterr().err


def test_the_target_runs_the_swapped_ops_through_vllms_own_wrapper(ops_033, swapped):
    installed = importlib.import_module("vllm.lora.ops.torch_ops")
    importlib.import_module("vllm.lora.punica_wrapper.punica_cpu")  # bound to the installed ops before the swap
    swapped.setenv(CPU_OPS_ENV, str(ops_033))
    target = VllmCpuTarget()
    counting = importlib.import_module("vllm.lora.ops.torch_ops.lora_ops")
    assert Path(counting.__file__).is_relative_to(ops_033) and counting.CALLS == []
    for op in ("bgmv_shrink", "bgmv_expand", "sgmv_expand_slice"):
        assert getattr(target, op) is getattr(counting, op) and getattr(target, op) is not getattr(installed, op)
    assert Path(target.bgmv_shrink.__code__.co_filename).is_relative_to(ops_033)
    run_case(target, probe_case("add_lora_linear", "float32"))  # PunicaWrapperCPU → its shrink → the swapped bgmv_shrink
    assert counting.CALLS, "vLLM's PunicaWrapperCPU did not call the swapped ops"


def test_the_facts_description_device_and_fingerprint_name_the_version_that_ran(ops_033, swapped):
    swapped.setenv(CPU_OPS_ENV, str(ops_033))
    target = VllmCpuTarget()
    assert facts_of(VllmCpuTarget).package_versions == {"vllm": "0.33.0"}
    assert "vllm 0.33.0's CPU LoRA ops" in VllmCpuTarget.description and str(ops_033) in VllmCpuTarget.description
    assert "vllm 0.33.0's CPU LoRA ops" in target.describe_device()["vllm_lora_ops"]
    fingerprint = environment_fingerprint(environ={CPU_OPS_ENV: str(ops_033)})
    assert "vllm 0.33.0's CPU LoRA ops" in fingerprint["vllm_cpu_lora_ops"]
    assert fingerprint["vllm"] == installed_vllm_version()  # the installed one stays recorded as such
    assert "vllm_cpu_lora_ops" not in environment_fingerprint(environ={})


def test_without_the_variable_the_target_runs_the_installed_ops_again(ops_033, swapped):
    swapped.setenv(CPU_OPS_ENV, str(ops_033))
    VllmCpuTarget()
    swapped.delenv(CPU_OPS_ENV)
    target = VllmCpuTarget()
    installed = importlib.import_module("vllm.lora.ops.torch_ops")
    assert not Path(installed.__file__).is_relative_to(ops_033) and target.bgmv_shrink is installed.bgmv_shrink
    assert facts_of(VllmCpuTarget).package_versions == {} and "0.33.0" not in VllmCpuTarget.description


def test_the_expectations_are_evaluated_against_the_version_of_the_ops_that_ran(ops_033, swapped, tmp_path):
    swapped.setenv(CPU_OPS_ENV, str(ops_033))
    VllmCpuTarget.check_available()
    run = ConformanceRun(RunSettings(target="cpu", report_dir=str(tmp_path / "r")), facts=facts_of(VllmCpuTarget))
    assert {entry.id for entry in run.expectations} == STILL_IN_033
    assert {entry["id"] for entry in run.expectations_not_applicable} == MINUS_ONE_ENTRIES
    installed = installed_vllm_version()
    assert {entry["not_applicable"] for entry in run.expectations_not_applicable} == {
        f"needs vllm <0.33; the target runs vllm 0.33.0 (installed: {installed})"
    }
    # the same file judged by the installed vllm-cpu 0.32.0 (no swap): every entry applies
    applicable, not_applicable = split_applicable(load_expectations(shipped_expectations("cpu")), version_lookup({}))
    assert len(applicable) == len(STILL_IN_033 | MINUS_ONE_ENTRIES) and not_applicable == []


def test_a_probe_reads_the_version_in_the_targets_own_process_and_refuses_a_bad_directory(ops_033, monkeypatch, tmp_path):
    monkeypatch.setenv(CPU_OPS_ENV, str(ops_033))
    assert probe("cpu").package_versions == {"vllm": "0.33.0"}
    monkeypatch.setenv(CPU_OPS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(TargetUnavailable, match=r"no such directory; build it with .*scripts/vllm-cpu-ops-from-wheel"):
        probe("cpu")


def _edit_manifest(directory: Path, change) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


BREAKAGES = {
    "missing": (lambda d: shutil.rmtree(d), "no such directory"),
    "no-manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    "not-json": (lambda d: (d / "manifest.json").write_text("{"), "is not a manifest of scripts/vllm-cpu-ops-from-wheel"),
    "format": (lambda d: _edit_manifest(d, lambda m: m.update(format=2)), "has format 2"),
    "version": (lambda d: _edit_manifest(d, lambda m: m.update(vllm_version="latest")), "not a PEP 440 version"),
    "edited": (lambda d: (d / LORA_OPS).write_text((d / LORA_OPS).read_text() + "\n# edited\n"), "does not match its sha256"),
    "layout": (lambda d: (d / LORA_OPS).rename(d / "lora_ops.py"), "is missing (wrong layout"),
    "stray": (lambda d: (d / TORCH_OPS_DIR / "extra.py").write_text(""), "extra.py not listed"),
    "unswappable": (
        lambda d: _edit_manifest(d, lambda m: m["files"].update({CPU_PATH_NOT_SWAPPABLE[0]: "0" * 64})), "which the swap cannot load"
    ),
    "installed-differs": (
        lambda d: _edit_manifest(d, lambda m: m["same_as_installed"].update({PUNICA_CPU: "0" * 64})),
        "built against another installed vLLM",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_directory_is_refused_naming_the_problem_and_the_fix(ops_033, swapped, tmp_path, breakage):
    directory = tmp_path / "ops"
    shutil.copytree(ops_033, directory)
    read_cpu_ops(directory)  # intact, the copy is accepted
    spoil, problem = BREAKAGES[breakage]
    spoil(directory)
    swapped.setenv(CPU_OPS_ENV, str(directory))
    with pytest.raises(CpuOpsError) as refused:
        VllmCpuTarget.check_available()
    message = str(refused.value)
    assert problem in message and "scripts/vllm-cpu-ops-from-wheel" in message and "\n" not in message
    assert isinstance(refused.value, TargetUnavailable)  # the run stops with it, never falls back to the installed ops
