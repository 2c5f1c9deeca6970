"""Imported once by the op benchmark's fork server, so that every measurement process starts with
torch, the suite and vLLM already imported (vLLM's import alone takes 10–40 s here)."""

import conformance.reference  # noqa: F401
from conformance.targets import registry

from .workload import IMPLEMENTATIONS

for _name, _ in IMPLEMENTATIONS.values():
    if _name != "reference":
        registry.resolve(_name).check_available()
