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
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from conformance.targets.device_traits import VISIBLE_DEVICES_ENV
from conformance.targets.facts import TargetFacts

if TYPE_CHECKING:  # pytest is this module's caller (the plugin), never imported for it
    import pytest

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


def visible_devices_variable(device_type: str | None, override: str | None) -> str | None:
    """The variable that selects a device of ``device_type`` (``--device-env`` first); None if none is known."""
    return override or VISIBLE_DEVICES_ENV.get(device_type)


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
    os.environ[variable] = device
    return {"variable": variable, "device": device}
