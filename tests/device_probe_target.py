"""A test target that declares the Gaudi device type but computes on the CPU, to test ``--devices``.

``--devices`` picks the visible-devices variable from the target class's ``default_device()`` (here
``hpu``, so ``HABANA_VISIBLE_MODULES``) and must set it before the target is loaded, as a runtime
reads it once when it loads. The probe writes what its process saw at load time to
``$LORA_CONFORMANCE_PROBE_DIR/<worker>.json``; it computes with the plain torch ops on the CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from fault_targets import PlainTorchTarget

PROBE_DIR_ENV = "LORA_CONFORMANCE_PROBE_DIR"


class GaudiShapedProbe(PlainTorchTarget):
    name = "gaudi-shaped-probe"
    description = "declares hpu, runs on the CPU, records HABANA_VISIBLE_MODULES at load (tests only)"

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("hpu")

    def __init__(self) -> None:
        seen = {"HABANA_VISIBLE_MODULES": os.environ.get("HABANA_VISIBLE_MODULES")}
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(os.environ[PROBE_DIR_ENV], f"{worker}.json").write_text(json.dumps(seen))
        super().__init__()
        self.device = torch.device("cpu")  # the declared type chose the variable; the work stays here
