"""The environment fingerprint: what a verdict was computed on, so two reports can be compared.

A verdict is only as meaningful as the stack under it: the same kernels pass or fail depending on the
torch build, the driver, and environment variables that switch numerics (TF32, lazy mode, graph
modes). Every run records, flat ``name → string`` so it fits results.json, JUnit test-suite
properties and Allure's ``environment.properties`` alike:

* the suite: its version and, from a git checkout, the commit and whether the tree was clean;
* the stack: Python, torch (and its CUDA build), vLLM, transformers, the installed lora-conformance,
  and Hypothesis, which draws the profiles: another version may draw other cases, so merging refuses
  shards drawn with different ones;
* with ``LORA_CONFORMANCE_VLLM_CPU_OPS``, ``vllm_cpu_lora_ops``: which vLLM release's CPU LoRA ops the
  ``cpu`` target runs in place of the installed ones (``vllm`` stays the installed version);
* the host and the device: its name and driver where they can be read (CUDA through torch and
  ``nvidia-smi``, Gaudi through ``habana_frameworks`` and ``hl-smi``, the CPU model otherwise), and its
  generation (``device_generation``: ``gaudi2``, ``gaudi3``, ``sm_90``, ``cpu``, or ``unknown``), what an
  expectations entry's ``devices`` scope names (``conformance.expectations``);
* the environment variables that change numerics or device placement (``NUMERICS_ENV``);
* each optional part missing here (``optional.<name>``: what the run skipped without it and how to install
  it, ``conformance.optional``).

Nothing here may fail a run: whatever cannot be read is recorded as such. Device runtimes are only
queried for the device type the target runs on, and only in the process that ran the cases, so a
fingerprint never initialises a runtime (or claims a device) that the run did not use.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import conformance
from conformance.optional import missing_parts

# Environment variables that change what the kernels compute, or where: exact names and prefixes.
NUMERICS_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "HABANA_VISIBLE_MODULES",
    "HABANA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "CUDA_LAUNCH_BLOCKING",
)
NUMERICS_ENV_PREFIXES = ("PT_HPU_", "HABANA_", "TORCH_", "MKL_", "VLLM_", "LORA_CONFORMANCE_", "HPU_")
# Never copied into a report, even under a numerics prefix: they may hold credentials.
SECRET_PATTERN = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)

NOT_A_CHECKOUT = "not a git checkout"
PACKAGES = {
    "torch": "torch",
    "vllm": "vllm",
    "transformers": "transformers",
    "lora-conformance": "lora-conformance",
    "hypothesis": "hypothesis",
}


def environment_fingerprint(device_type: str | None = None, environ=None) -> dict[str, str]:
    """The fingerprint of this process: suite, stack, host, device (of ``device_type``) and numerics env."""
    fingerprint = {"suite_version": conformance.__version__, **git_state(), "python": platform.python_version()}
    fingerprint.update(package_versions())
    fingerprint.update(missing_parts())
    if ops := _vllm_cpu_ops(environ):
        fingerprint["vllm_cpu_lora_ops"] = ops
    fingerprint.update(host=platform.node() or "unknown", platform=platform.platform())
    if device_type:
        fingerprint.update(device_description(device_type))
    fingerprint.update({f"env.{name}": value for name, value in numerics_env(environ).items()})
    return fingerprint


def git_state(root: Path | None = None) -> dict[str, str]:
    """``git_commit`` and ``git_tree`` (clean / dirty) of the suite's checkout, or that it is none."""
    root = root or Path(conformance.__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        return {"git_commit": NOT_A_CHECKOUT, "git_tree": NOT_A_CHECKOUT}
    commit = _command(["git", "-C", str(root), "rev-parse", "HEAD"])
    status = _command(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    if commit is None:
        return {"git_commit": NOT_A_CHECKOUT, "git_tree": NOT_A_CHECKOUT}
    return {"git_commit": commit, "git_tree": "unknown" if status is None else ("clean" if not status else "dirty")}


def package_versions() -> dict[str, str]:
    """Installed versions, from package metadata (importing vLLM just to ask would cost seconds)."""
    versions = {}
    for key, distribution in PACKAGES.items():
        versions[key] = _version(distribution)
    if versions["vllm"] == "not installed":  # the CPU build ships as vllm-cpu
        versions["vllm"] = _version("vllm-cpu")
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = torch.__version__
        versions["torch_cuda"] = str(torch.version.cuda)
    return versions


def _vllm_cpu_ops(environ=None) -> str | None:
    """What ``LORA_CONFORMANCE_VLLM_CPU_OPS`` swaps into the ``cpu`` target, or None where it is unset.

    Read from the directory's manifest here, not through the target's module: the referee's process
    imports no target (tests/test_layers.py). The ``cpu`` target checks the directory in full when it
    starts, and refuses to run a directory that does not match its manifest."""
    directory = (os.environ if environ is None else environ).get("LORA_CONFORMANCE_VLLM_CPU_OPS", "")
    if not directory:
        return None
    try:
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
        return f"vllm {manifest['vllm_version']}'s CPU LoRA ops from {manifest['wheel']['file']}, in {directory}"
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a fingerprint never fails the run it describes
        return f"unreadable: {exc!r}"


UNKNOWN_GENERATION = "unknown"


def device_description(device_type: str) -> dict[str, str]:
    """``device`` (name), ``driver`` and ``device_generation`` of the device type a target runs on; never raises."""
    try:
        if device_type == "cuda":
            return _cuda()
        if device_type == "hpu":
            return _hpu()
        if device_type == "cpu":
            return {"device": f"cpu: {_cpu_model()}", "driver": "n/a", "device_generation": "cpu"}
        # a device type the suite does not know: say so, rather than pass the host's CPU off as the device
        return {"device": f"{device_type}: not described (a device type the suite has no reader for)", "driver": "unknown",
                "device_generation": UNKNOWN_GENERATION}
    except Exception as exc:  # noqa: BLE001 - a fingerprint must never fail the run it describes
        return {"device": f"{device_type}: unreadable ({type(exc).__name__}: {exc})", "driver": "unknown",
                "device_generation": UNKNOWN_GENERATION}


def gaudi_generation(name: str) -> str:
    """A Gaudi's generation from its device name, as ``habana_frameworks`` gives it: ``GAUDI2`` → ``gaudi2``,
    ``GAUDI3`` → ``gaudi3``, ``GAUDI`` → ``gaudi1``; any other name lower-cased."""
    name = name.strip()
    match = re.fullmatch(r"GAUDI(\d?)", name.upper())
    if match:
        return f"gaudi{match.group(1) or 1}"
    return name.lower() or UNKNOWN_GENERATION


def _cuda() -> dict[str, str]:
    import torch

    available = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if available else "no CUDA device visible"
    generation = "sm_{}{}".format(*torch.cuda.get_device_capability()) if available else UNKNOWN_GENERATION
    driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
    return {"device": f"cuda: {name}", "driver": driver or "unknown (nvidia-smi not readable)", "device_generation": generation}


def _hpu() -> dict[str, str]:
    try:
        import habana_frameworks.torch.hpu as hthpu  # only here: the package is absent off Gaudi
    except ImportError as exc:
        return {"device": f"hpu: habana_frameworks not importable ({exc})", "driver": "unknown", "device_generation": UNKNOWN_GENERATION}
    available = hthpu.is_available()
    name = hthpu.get_device_name() if available else "no HPU visible"
    driver = _command(["hl-smi", "-Q", "driver_version", "-f", "csv,noheader"])
    return {
        "device": f"hpu: {name}",
        "driver": (driver or "unknown (hl-smi not readable)").splitlines()[0],
        "device_generation": gaudi_generation(str(name)) if available else UNKNOWN_GENERATION,
        "habana_torch_plugin": _version("habana-torch-plugin"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def numerics_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {
        name: value
        for name, value in sorted(environ.items())
        if (name in NUMERICS_ENV_NAMES or name.startswith(NUMERICS_ENV_PREFIXES)) and not SECRET_PATTERN.search(name)
    }


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _command(argv: list[str]) -> str | None:
    """The stripped output of a short command, or None when it is missing, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip() if completed.returncode == 0 else None
