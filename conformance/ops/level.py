"""The levels of the design, as an enum: where in vLLM's stack a case sits.

``kernel``: the Triton/torch kernels (bgmv/sgmv, lora_shrink/lora_expand); ``wrapper``: the
PunicaWrapper methods a LoRA layer calls; ``layer``: a LoRA layer as a whole (tensor-parallel
composition); ``model``: end-to-end generation. The order is the design's, and the report's.
"""

from __future__ import annotations

import enum


class Level(str, enum.Enum):
    KERNEL = "kernel"
    WRAPPER = "wrapper"
    LAYER = "layer"
    MODEL = "model"

    def __str__(self) -> str:
        return self.value


LEVEL_ORDER = tuple(level.value for level in Level)
