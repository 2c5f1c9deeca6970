"""The ``reference`` target: the golden reference itself, run in the case dtype.

It is the low-precision baseline every other target is measured against, so it passes by
construction; it exists to check the harness end to end and as a model of a complete target. Its ops
are the reference functions the op specs name (``OpSpec.reference``): a new op is served here as
soon as its spec is registered.
"""

from __future__ import annotations

import functools

from conformance.ops import OP_SPECS, Level
from conformance.reference import PunicaWrapperReference

from .base import Target


class ReferenceTarget(PunicaWrapperReference, Target):
    name = "reference"
    description = "the suite's golden reference in the case dtype (the low-precision baseline)"

    def __init__(self) -> None:
        Target.__init__(self)
        PunicaWrapperReference.__init__(self, self.device)

    def __getattr__(self, name: str):
        """An op the class does not define: the reference function its spec names."""
        spec = OP_SPECS.get(name)
        if spec is None:
            raise AttributeError(name)
        if spec.level == Level.KERNEL:
            return spec.reference
        return functools.partial(spec.reference, self)  # a wrapper op: a method of the reference wrapper
