"""What the harness must know of a device type, apart from any target: the variable that selects one
device of it, and the ``torch.distributed`` backend its tensor-parallel ranks use.

A target states its device's traits (``Target.device_traits``); ``conformance.devices`` assigns devices
to pytest workers from them. This module imports nothing of the suite, so both can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The built-in device types' facts; a target on another device type states its own (Target.device_traits).
VISIBLE_DEVICES_ENV = {"hpu": "HABANA_VISIBLE_MODULES", "cuda": "CUDA_VISIBLE_DEVICES"}
DISTRIBUTED_BACKEND = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}


@dataclass(frozen=True)
class DeviceTraits:
    """What the harness must know of a device type: which variable selects one device of it (for
    ``--devices``), which ``torch.distributed`` backend its tensor-parallel ranks use (None: the target
    runs no tensor-parallel case, reported not supported), and its name."""

    type: str
    visible_devices_env: str | None
    distributed_backend: str | None

    @classmethod
    def builtin(cls, device_type: str) -> DeviceTraits:
        """The traits the suite knows for ``device_type`` (None where it knows none)."""
        return cls(device_type, VISIBLE_DEVICES_ENV.get(device_type), DISTRIBUTED_BACKEND.get(device_type))
