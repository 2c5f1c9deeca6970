"""The ``reference`` target: the golden reference itself, run in the case dtype.

It is the low-precision baseline every other target is measured against, so it passes by
construction; it exists to check the harness end to end and as a model of a complete target.
"""

from __future__ import annotations

from conformance import reference
from conformance.reference import PunicaWrapperReference

from .base import Target


class ReferenceTarget(PunicaWrapperReference, Target):
    name = "reference"
    description = "the suite's golden reference in the case dtype (the low-precision baseline)"

    bgmv_shrink = staticmethod(reference.bgmv_shrink)
    bgmv_expand = staticmethod(reference.bgmv_expand)
    bgmv_expand_slice = staticmethod(reference.bgmv_expand_slice)
    sgmv_shrink = staticmethod(reference.sgmv_shrink)
    sgmv_expand = staticmethod(reference.sgmv_expand)
    sgmv_expand_slice = staticmethod(reference.sgmv_expand_slice)
    lora_shrink = staticmethod(reference.lora_shrink)
    lora_expand = staticmethod(reference.lora_expand)

    def __init__(self) -> None:
        Target.__init__(self)
        PunicaWrapperReference.__init__(self, self.device)
