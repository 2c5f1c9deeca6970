"""Imported once by the MoE benchmark's fork server, so that every measurement process starts with torch,
the reference and the HPU targets already imported (no vLLM: no MoE implementation here needs it)."""

import conformance.reference  # noqa: F401
from conformance.targets import registry

from .moe_workload import IMPLEMENTATIONS

for _name, _ in IMPLEMENTATIONS.values():
    if _name not in ("reference", "plain-gather"):
        registry.resolve(_name).check_available()
