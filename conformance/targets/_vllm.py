"""Finding vLLM, and running another vLLM release's CPU LoRA ops in place of the installed ones.

:func:`import_vllm_module` imports a vLLM module or says which package to install; :func:`vllm_version`
is the imported vLLM's version. Speaking vLLM's mapping and wrapper API is
:mod:`conformance.targets.vllm_wrapper`'s (``VllmPunicaWrapperTarget``).

The ``cpu`` target can also run another vLLM release's CPU LoRA ops without installing that release
(``LORA_CONFORMANCE_VLLM_CPU_OPS=DIR``, a directory ``scripts/vllm-cpu-ops-from-wheel`` wrote):
:func:`read_cpu_ops` checks the directory, :func:`swap_cpu_ops` loads its files in place of the
installed ones (docs/targets.md, "Another vLLM release's CPU ops").
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import TargetUnavailable


def import_vllm_module(name: str, target: str) -> Any:
    """Import a vLLM module or raise :class:`TargetUnavailable` naming the package to install."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise TargetUnavailable(
            f"target {target!r} needs vLLM ({name} failed to import: {exc}); "
            "install it, e.g. pip install -c constraints/cpu.txt 'lora-conformance[vllm]'"
        ) from exc


def vllm_version() -> str:
    try:
        return importlib.import_module("vllm").__version__
    except Exception:  # noqa: BLE001 - only for messages
        return "unknown"


# -- another vLLM release's CPU LoRA ops, in place of the installed ones (the cpu target) --------------

CPU_OPS_ENV = "LORA_CONFORMANCE_VLLM_CPU_OPS"
CPU_OPS_MANIFEST = "manifest.json"
CPU_OPS_FORMAT = 1
# The pure-torch files of vLLM's CPU LoRA path, as paths inside the vllm package's wheel. vLLM's torch
# ops (every .py of the package) always come from the other release; PunicaWrapperCPU does where it
# differs from the installed one (it is reloaded either way, as it binds the ops at import). The wrapper's
# base class and metadata helpers are checked, never swapped: every other vLLM module shares their
# classes, so a release that changed them cannot be run this way.
TORCH_OPS_DIR = "vllm/lora/ops/torch_ops"
TORCH_OPS_MODULE = "vllm.lora.ops.torch_ops"
PUNICA_CPU = "vllm/lora/punica_wrapper/punica_cpu.py"
PUNICA_CPU_MODULE = "vllm.lora.punica_wrapper.punica_cpu"
CPU_PATH_NOT_SWAPPABLE = ("vllm/lora/punica_wrapper/punica_base.py", "vllm/lora/punica_wrapper/utils.py")
CPU_OPS_BUILD = ".venv/bin/python scripts/vllm-cpu-ops-from-wheel VERSION DIR"


class CpuOpsError(TargetUnavailable):
    """A ``LORA_CONFORMANCE_VLLM_CPU_OPS`` directory that cannot be run; the message names the problem and the fix."""


@dataclass(frozen=True)
class CpuOps:
    """A checked directory of another vLLM release's CPU LoRA ops (its ``manifest.json``)."""

    directory: Path
    vllm_version: str  # the release the files come from
    wheel: str  # the wheel they were read from, and its sha256
    swapped: dict[str, str]  # wheel path → sha256, of the files in the directory (loaded in place of the installed)
    same_as_installed: dict[str, str]  # wheel path → sha256, of the files the release shares with the installed vLLM

    def summary(self) -> str:
        swapped = ", ".join(sorted(self.swapped))
        return (f"vllm {self.vllm_version}'s CPU LoRA ops from {self.wheel}: {swapped} in {self.directory}, "
                f"in place of the installed vllm {installed_vllm_version()}'s")


def installed_vllm_version() -> str:
    """The installed vLLM distribution's version, from metadata (vllm or vllm-cpu), without importing it."""
    from importlib import metadata

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def installed_vllm_file(path: str) -> Path:
    """An installed file of the vllm package, by its path inside the wheel (``vllm/...``), without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CpuOpsError(f"{CPU_OPS_ENV} swaps files of the installed vLLM, and none is installed: "
                          "pip install -c constraints/cpu.txt 'lora-conformance[vllm]'")
    return Path(next(iter(spec.submodule_search_locations))).parent / path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_cpu_ops(directory: str | Path) -> CpuOps:
    """The checked contents of a ``LORA_CONFORMANCE_VLLM_CPU_OPS`` directory; :class:`CpuOpsError` naming
    the problem and the fix where it is missing, laid out otherwise, or not what its manifest says."""
    from packaging.version import InvalidVersion, Version

    root = Path(directory)
    where = f"{CPU_OPS_ENV}={directory}"
    rebuild = f"rebuild it with {CPU_OPS_BUILD} (or unset {CPU_OPS_ENV} to run the installed vLLM's ops)"
    if not root.is_dir():
        raise CpuOpsError(f"{where}: no such directory; build it with {CPU_OPS_BUILD} "
                          f"(or unset {CPU_OPS_ENV} to run the installed vLLM's ops)")
    manifest_path = root / CPU_OPS_MANIFEST
    if not manifest_path.is_file():
        raise CpuOpsError(f"{where}: no {CPU_OPS_MANIFEST}, so not a directory scripts/vllm-cpu-ops-from-wheel wrote; {rebuild}")
    try:
        manifest = json.loads(manifest_path.read_text())
        version, wheel = str(manifest["vllm_version"]), manifest["wheel"]
        swapped, same = dict(manifest["files"]), dict(manifest["same_as_installed"])
        fmt = manifest["format"]
        wheel_text = f"{wheel['file']} (sha256 {wheel['sha256']})"
        if not all(isinstance(key, str) and isinstance(value, str) for table in (swapped, same) for key, value in table.items()):
            raise TypeError("'files' and 'same_as_installed' must map paths to sha256 strings")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CpuOpsError(f"{where}: {CPU_OPS_MANIFEST} is not a manifest of scripts/vllm-cpu-ops-from-wheel "
                          f"({type(exc).__name__}: {exc}); {rebuild}") from None
    if fmt != CPU_OPS_FORMAT:
        raise CpuOpsError(f"{where}: {CPU_OPS_MANIFEST} has format {fmt!r}, this suite reads format {CPU_OPS_FORMAT}; {rebuild}")
    try:
        Version(version)
    except InvalidVersion:
        raise CpuOpsError(f"{where}: {CPU_OPS_MANIFEST} says vllm_version {version!r}, not a PEP 440 version; {rebuild}") from None
    init = f"{TORCH_OPS_DIR}/__init__.py"
    if init not in swapped:
        raise CpuOpsError(f"{where}: {CPU_OPS_MANIFEST} lists no {init}: the torch ops must come from the other release; {rebuild}")
    for path in swapped:
        if not (path.startswith(f"{TORCH_OPS_DIR}/") and path.endswith(".py") or path == PUNICA_CPU):
            raise CpuOpsError(f"{where}: {CPU_OPS_MANIFEST} lists {path}, which the swap cannot load (only {TORCH_OPS_DIR}/*.py "
                              f"and {PUNICA_CPU}); {rebuild}")
    for path in (PUNICA_CPU, *CPU_PATH_NOT_SWAPPABLE):
        if path not in swapped and path not in same:
            raise CpuOpsError(f"{where}: {CPU_OPS_MANIFEST} says nothing of {path} (neither in 'files' nor in "
                              f"'same_as_installed'); {rebuild}")
    for path, digest in sorted(swapped.items()):
        if not (root / path).is_file():
            raise CpuOpsError(f"{where}: {path} is missing (wrong layout: the files keep their paths inside the wheel, "
                              f"under DIR/vllm/...); {rebuild}")
        if sha256_of(root / path) != digest:
            raise CpuOpsError(f"{where}: {path} does not match its sha256 in {CPU_OPS_MANIFEST} (changed after "
                              f"extraction); {rebuild}")
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*.py")}
    if stray := sorted(on_disk - set(swapped)):
        raise CpuOpsError(f"{where}: {', '.join(stray)} not listed in {CPU_OPS_MANIFEST} (a file added by hand would be "
                          f"imported too); {rebuild}")
    for path, digest in sorted(same.items()):
        installed = installed_vllm_file(path)
        if not installed.is_file() or sha256_of(installed) != digest:
            raise CpuOpsError(
                f"{where}: the installed vllm {installed_vllm_version()}'s {path} is not vllm {version}'s, which the "
                f"directory relies on (it was built against another installed vLLM); {rebuild}"
            )
    return CpuOps(root.resolve(), version, wheel_text, swapped, same)


_SWAP: dict = {}  # this process's swap: "ops" (CpuOps), "torch_ops", "wrapper_class", "saved" (the installed modules)


def swap_cpu_ops(ops: CpuOps, target: str) -> tuple[Any, type]:
    """Load the directory's files under the installed modules' names: ``vllm.lora.ops.torch_ops`` (and
    its submodules) from the directory, then ``vllm.lora.punica_wrapper.punica_cpu`` from the directory
    or, where the release shares it, again from the installed file, so that its
    ``from vllm.lora.ops.torch_ops import ...`` binds the swapped ops. Returns the torch ops package and
    ``PunicaWrapperCPU``; once per process (a second directory is refused)."""
    if _SWAP:
        if _SWAP["ops"].directory != ops.directory:
            raise CpuOpsError(f"{CPU_OPS_ENV}: this process already runs the ops of {_SWAP['ops'].directory}, not "
                              f"{ops.directory}; start a new process")
        return _SWAP["torch_ops"], _SWAP["wrapper_class"]
    import_vllm_module("vllm.lora.layers", target)  # the installed vLLM first, as the target imports it
    parent_ops = import_vllm_module("vllm.lora.ops", target)
    parent_wrapper = import_vllm_module("vllm.lora.punica_wrapper", target)
    names = [name for name in sys.modules if name == TORCH_OPS_MODULE or name.startswith(TORCH_OPS_MODULE + ".")]
    saved = {name: sys.modules.get(name) for name in [*names, PUNICA_CPU_MODULE]}
    try:
        for name in names:
            del sys.modules[name]
        package_dir = ops.directory / TORCH_OPS_DIR
        torch_ops = _load(TORCH_OPS_MODULE, package_dir / "__init__.py", search=package_dir)
        parent_ops.torch_ops = torch_ops
        punica_file = ops.directory / PUNICA_CPU if PUNICA_CPU in ops.swapped else installed_vllm_file(PUNICA_CPU)
        punica_cpu = _load(PUNICA_CPU_MODULE, punica_file)
        parent_wrapper.punica_cpu = punica_cpu
    except Exception as exc:  # noqa: BLE001 - whatever the other release's code raises at import
        _restore(saved)
        raise CpuOpsError(f"{CPU_OPS_ENV}={ops.directory}: vllm {ops.vllm_version}'s CPU LoRA files do not load under the "
                          f"installed vllm {installed_vllm_version()} ({type(exc).__name__}: {exc}); run that release's "
                          "own CPU build instead") from None
    loaded = {name: module for name, module in sys.modules.items() if name.startswith(TORCH_OPS_MODULE)}
    outside = sorted(name for name, module in loaded.items() if not _inside(module, ops.directory))
    unbound = [op for op in ("bgmv_shrink", "sgmv_expand") if getattr(punica_cpu, op, None) is not getattr(torch_ops, op, None)]
    if outside or unbound:
        _restore(saved)
        raise CpuOpsError(f"{CPU_OPS_ENV}={ops.directory}: the swap did not take ({', '.join(outside)} not from the "
                          f"directory; PunicaWrapperCPU's {', '.join(unbound)} not the swapped ops); report this")
    _SWAP.update(ops=ops, torch_ops=torch_ops, wrapper_class=punica_cpu.PunicaWrapperCPU, saved=saved)
    return torch_ops, punica_cpu.PunicaWrapperCPU


def restore_installed_cpu_ops() -> None:
    """Undo this process's :func:`swap_cpu_ops`: the installed modules back under their names."""
    if _SWAP:
        _restore(_SWAP["saved"])
        _SWAP.clear()


def _restore(saved: dict) -> None:
    for name in [name for name in sys.modules if name == TORCH_OPS_MODULE or name.startswith(TORCH_OPS_MODULE + ".")]:
        del sys.modules[name]
    for name, module in saved.items():
        if module is not None:
            sys.modules[name] = module
        else:
            sys.modules.pop(name, None)
    for name in (TORCH_OPS_MODULE, PUNICA_CPU_MODULE):  # the packages' attributes, as an import sets them
        parent, _, child = name.rpartition(".")
        if parent not in sys.modules:
            continue
        if name in sys.modules:
            setattr(sys.modules[parent], child, sys.modules[name])
        elif hasattr(sys.modules[parent], child):
            delattr(sys.modules[parent], child)


def _load(name: str, path: Path, search: Path | None = None):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(search)] if search is not None else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _inside(module, directory: Path) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).resolve().is_relative_to(directory)
