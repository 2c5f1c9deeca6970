"""One device per xdist worker: ``--devices=0,1,2,3`` (or ``auto``) with ``-n``.

Device runtimes read their visible-device variable once, when they load (CUDA at its first call,
Habana when ``habana_frameworks`` is imported). So each worker sets the variable for the target's
device type in its own environment *before* the target is loaded, and every runtime in that process
sees exactly one device, which it calls device 0:

    worker gwN gets the N-th entry of --devices (``auto``: device N).

Which variable: ``HABANA_VISIBLE_MODULES`` for a target on ``hpu``, ``CUDA_VISIBLE_DEVICES`` on
``cuda`` (from the target class's ``default_device()``, which loads no runtime), or the one named by
``--device-env`` for other devices. The controller of an xdist run loads no device for cases and keeps
its environment; a serial run takes the first device.

Tensor-parallel ranks choose their devices from the same list (``conformance.tp.placement``); which
devices exist at all is :func:`visible_device_ids`: the ids the variable held before ``--devices`` set
it, else as many as the device's runtime counts in a short process of its own (``python -m
conformance.devices count TYPE MODULE``: the referee's process loads no device runtime).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

from conformance.targets.device_traits import VISIBLE_DEVICES_ENV
from conformance.targets.facts import TargetFacts

if TYPE_CHECKING:  # pytest is this module's caller (the plugin), never imported for it
    import pytest

COUNT_TIMEOUT = 300.0  # seconds for the counting process to load torch (and, for some devices, the target's module)

# The visible-devices variable's value before assign_device set it for this process (None: it was unset): the
# devices that exist are those, not the one this worker was given.
_BEFORE_ASSIGNMENT: dict[str, str | None] = {}

# The module that counts a device type's devices where torch itself does not know the type. Gaudi's PyTorch
# bridge: habana_frameworks.torch.hpu.device_count() (DeepSpeed's HPU accelerator counts with it,
# accelerator/hpu_accelerator.py); the suite's Gaudi targets import habana_frameworks only when they load.
RUNTIME_MODULES = {"hpu": "habana_frameworks.torch.hpu"}

# The errors below are ValueErrors, so that a run driven from a script (conformance.session) gets them
# too; the plugin turns them into pytest usage errors.


def parse_devices(value: str | None) -> list[str] | str | None:
    """``None``, ``"auto"`` or the list of device ids of ``--devices``."""
    if value is None:
        return None
    if value == "auto":
        return "auto"
    devices = [part.strip() for part in value.split(",")]
    if not all(devices) or len(set(devices)) != len(devices):
        raise ValueError(f"--devices expects 'auto' or distinct ids separated by commas (0,1,2,3), got {value!r}")
    return devices


def visible_devices_env(facts: TargetFacts, override: str | None) -> str:
    """The variable that selects a device of the target's device type (its facts, ``--device-env`` first)."""
    if override:
        return override
    variable, device_type = facts.visible_devices_env, facts.device_type
    if variable is None:
        raise ValueError(
            f"--devices: target {facts.name!r} runs on {device_type or 'an unknown device'}, which has no known "
            f"visible-devices variable (known: {', '.join(f'{k}: {v}' for k, v in VISIBLE_DEVICES_ENV.items())}); "
            "name it with --device-env=VAR"
        )
    return variable


def worker_index(config: pytest.Config) -> tuple[int, int] | None:
    """``(N, count)`` for xdist worker gwN of ``count``; None in a serial run or the controller."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    return int(workerinput["workerid"].removeprefix("gw")), int(workerinput["workercount"])


def _check_worker_count(config: pytest.Config, devices: list[str] | str) -> None:
    """Refuse more workers than devices (two processes on one Gaudi card fail)."""
    workers = getattr(config.option, "numprocesses", None) or 0
    if isinstance(devices, list) and isinstance(workers, int) and workers > len(devices):
        raise ValueError(
            f"-n {workers} workers but --devices lists {len(devices)}: one device per worker; "
            f"list {workers} devices or run -n {len(devices)}"
        )


def assign_device(config: pytest.Config, facts: TargetFacts) -> dict | None:
    """Set this process's visible-devices variable from ``--devices``; what was set, for the results.

    The controller of an xdist run only checks the option (so a mistake is one usage error, not a
    crash of every worker) and sets nothing: it runs no case, so it claims no device.
    """
    devices = parse_devices(config.option.devices)
    if devices is None:
        return None
    variable = visible_devices_env(facts, config.option.device_env)
    index = worker_index(config)
    if index is None and getattr(config.option, "numprocesses", None):
        _check_worker_count(config, devices)
        return None
    position = index[0] if index else 0
    device = str(position) if devices == "auto" else devices[position]
    _BEFORE_ASSIGNMENT.setdefault(variable, os.environ.get(variable))
    os.environ[variable] = device
    return {"variable": variable, "device": device}


def visible_device_ids(device_type: str, variable: str | None, module: str) -> list[str] | None:
    """The ids of the ``device_type`` devices that exist for this run, as ``variable`` selects them; None where
    nothing can tell (the CPU; a runtime without ``device_count``). ``ValueError`` where the count fails.

    The variable's own list where the environment set it (a lab's ``CUDA_VISIBLE_DEVICES=2,3``: ranks must
    stay on those), else ``0 … n-1`` for the ``n`` devices the runtime counts with the variable unset.
    """
    if variable:
        before = _BEFORE_ASSIGNMENT[variable] if variable in _BEFORE_ASSIGNMENT else os.environ.get(variable)
        if before is not None:
            return [part.strip() for part in before.split(",") if part.strip()]
    if device_type == "cpu":
        return None
    env = {key: value for key, value in os.environ.items() if key != variable}
    command = [sys.executable, "-m", "conformance.devices", "count", device_type, module]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COUNT_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        raise ValueError(f"counting the {device_type} devices here ({' '.join(command[1:])}) took over {COUNT_TIMEOUT:g} s; "
                         "name the devices with --devices") from None
    answer = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    if answer == ["unknown"]:
        return None
    if not answer or not answer[0].isdigit():
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"could not count the {device_type} devices here ({' '.join(command[1:])}: {error[:300]}); "
                         "name the devices with --devices")
    return [str(index) for index in range(int(answer[0]))]


def count_devices(device_type: str, module: str) -> str:
    """How many ``device_type`` devices the runtime counts, as text ("unknown" where nothing here counts them):
    ``torch.<device_type>.device_count()``; where torch does not know the device type, after importing the
    target's module (it may register the type), else its runtime's own module (:data:`RUNTIME_MODULES`)."""
    import importlib

    import torch

    runtime = getattr(torch, device_type, None)
    if not hasattr(runtime, "device_count"):
        importlib.import_module(module)
        runtime = getattr(torch, device_type, None)
    if not hasattr(runtime, "device_count") and device_type in RUNTIME_MODULES:
        try:
            runtime = importlib.import_module(RUNTIME_MODULES[device_type])
        except ImportError:  # the runtime is not installed: nothing counts its devices (the target says it cannot run)
            runtime = None
    return str(runtime.device_count()) if hasattr(runtime, "device_count") else "unknown"


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "count":
        print("usage: python -m conformance.devices count DEVICE_TYPE TARGET_MODULE", file=sys.stderr)
        return 2
    print(count_devices(argv[1], argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
