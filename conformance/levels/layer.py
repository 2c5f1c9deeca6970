"""Tensor-parallel layer cases (design level 3): vLLM's sharded LoRA layers, one process per rank.

The target runs in a pool of rank processes (``conformance.tp``); the gathered output is judged here,
in the referee's process, against the float64 reference of the whole layer. Whether the target runs a
case at all is decided here from its facts (the wrapper methods the layer calls on every rank, its
dtypes, a ``torch.distributed`` backend for its device), before any rank starts.
"""

from __future__ import annotations

import dataclasses

from conformance.digest import tensors_digest
from conformance.errors import RunError
from conformance.levels.context import LevelContext
from conformance.record import CaseResult
from conformance.targets.facts import TargetFacts
from conformance.tp.case import TPCase
from conformance.tp.cases import tp_cases
from conformance.tp.moe_case import MoETPCase
from conformance.tp.moe_layer import moe_tensors
from conformance.tp.run import TPResult, unsupported_reason
from conformance.tp.values import layer_tensors

from .base import CaseKind


class LayerKind(CaseKind):
    name = "layer"
    markers = {"tp": "a tensor-parallel LoRA layer case (design level 3, the layer; conformance.tp)"}
    result_type = TPResult
    uses_worker = False  # its own rank processes (conformance.tp.pool), not the op worker

    def owns(self, case) -> bool:
        return isinstance(case, (TPCase, MoETPCase))

    def cases(self, profile: str, seed: int) -> list[tuple[str, TPCase | MoETPCase]]:
        return [(case.case_id, case) for case in tp_cases(profile, seed)]

    def case_from_json(self, data: dict) -> TPCase | MoETPCase:
        return (MoETPCase if "num_experts" in data else TPCase).from_json(data)

    def inputs_digest(self, case: TPCase | MoETPCase) -> str:
        """The unsharded layer's tensors, drawn from the case's seed as the referee draws them."""
        drawn = moe_tensors(case) if isinstance(case, MoETPCase) else layer_tensors(case)
        named = {}
        for field in dataclasses.fields(drawn):
            value = getattr(drawn, field.name)
            if isinstance(value, tuple):  # a stack per slice
                named.update({f"{field.name}.{index}": tensor for index, tensor in enumerate(value)})
            else:
                named[field.name] = value
        return tensors_digest(named)

    def unsupported_reason(self, facts: TargetFacts, case: TPCase | MoETPCase) -> str | None:
        """``conformance.tp.run.unsupported_reason``: the executor asks it again, as a second line, before a pool starts."""
        return unsupported_reason(facts, case)

    def run(self, context: LevelContext, case_id: str, case: TPCase | MoETPCase, values=None) -> CaseResult:
        try:
            return context.tp_executor.run(case)
        except ValueError as exc:  # --devices cannot give every rank a device: the run's options, not the target
            raise RunError(str(exc)) from None


LAYER = LayerKind()
