"""Every op the suite judges, as data (``OpSpec``), by name."""

from .kernel import KERNEL_OP_SPECS
from .spec import KNOBS, OpCall, OpSpec
from .wrapper import WRAPPER_OP_SPECS, case_mapping

OP_SPECS: dict[str, OpSpec] = {spec.name: spec for spec in (*KERNEL_OP_SPECS, *WRAPPER_OP_SPECS)}
OP_NAMES = tuple(OP_SPECS)

__all__ = ["KNOBS", "OP_NAMES", "OP_SPECS", "OpCall", "OpSpec", "case_mapping"]
