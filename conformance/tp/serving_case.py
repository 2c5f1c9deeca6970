"""A tensor-parallel serving case: the ranks of one sharded LoRA layer, each a target instance built once, step after step.

The serving level's protocol (``conformance.serving.case``: capacities fixed at start-up, steps that load
and evict adapters, batches padded to a captured size on persistent buffers, graphs captured and replayed)
applied to vLLM's sharded linear LoRA layers (``conformance.tp.case``): every rank keeps its shard of the
persistent buffers (activations, the base output, the stacks, and the shrink buffers of fully sharded
layers) and writes each step's shard into them. A step's layer runs as vLLM's piecewise graphs run it:
the wrapper calls between two collectives are one captured piece each, the collectives run between the
pieces on the persistent buffers (``conformance.tp.serving_rank``).

Every step's real rows are judged as the tensor-parallel case of the same batch (:meth:`TPServingCase.step_case`,
``conformance.tp.judgement``), so, as for one process, the serving level adds the state, not numerics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from conformance.cases.case import SHORT_DTYPE
from conformance.query import case_id
from conformance.serving.case import ServedSequence, ServingStep, sequence_features, sequence_problems

from .case import TPCase


@dataclass(frozen=True)
class TPServingCase(ServedSequence):
    family: str  # the scenario (conformance.serving.scenarios.SCENARIOS)
    layer: TPCase  # the sharded layer's shape, sharding and dtype (its batch fields are each step's: step_case)
    adapter_ranks: tuple[int, ...]  # the adapter pool: more adapters than slots, so steps load and evict
    max_tokens: int  # the persistent buffers' rows
    graph_policy: str  # one of GRAPH_POLICIES
    graphs: tuple[tuple[int, int], ...]  # the captured keys: (batch size, adapter count)
    steps: tuple[ServingStep, ...]
    seed: int
    layer_type: ClassVar[type] = TPCase
    what: ClassVar[str] = "tensor-parallel serving case"

    def __post_init__(self) -> None:
        problems = sequence_problems(self.graph_policy, self.graphs, self.steps, self.layer.num_slots, self.max_tokens)
        if any(rank < 1 or rank > self.layer.max_rank for rank in self.adapter_ranks):
            problems.append(f"adapter ranks {self.adapter_ranks} must lie in [1, {self.layer.max_rank}]")
        if problems:
            raise ValueError("invalid tensor-parallel serving case: " + "; ".join(problems))
        for index in range(len(self.steps)):
            self.step_case(index)  # every step's batch a valid tensor-parallel case (ValueError names the field)

    @property
    def tp_size(self) -> int:
        return self.layer.tp_size

    @property
    def case_id(self) -> str:
        layer = self.layer
        return case_id("serving", self.family, {
            "op": self.op, "tp": layer.tp_size, "dtype": SHORT_DTYPE[layer.dtype], "fully_sharded": layer.fully_sharded,
            "kv_replicas": layer.kv_replicas if layer.kv_replicas > 1 else None,
            "index_kv_replicas": layer.index_kv_replicas if layer.index_kv_replicas > 1 else None, "graphs": self.graph_policy,
            "steps": len(self.steps), "seed": self.seed,
        })

    def step_case(self, index: int) -> TPCase:
        """Step ``index``'s real batch as a tensor-parallel case: what the oracle computes and the verdict judges."""
        step = self.steps[index]
        return dataclasses.replace(self.layer, seq_lens=step.seq_lens, seq_slots=step.seq_slots, is_prefill=step.is_prefill,
                                   seed=self.seed * 1000 + index, family=self.family)

    def features(self) -> frozenset[str]:
        """The serving features of the sequence (as a one-process case's), and every feature of every step's batch as
        a layer case (TP size, sharding, rows of slot −1, decode): a known failure of the layer matches it."""
        serving = sequence_features(self.family, self.graph_policy, self.steps)
        serving = serving.union(*(self.step_case(index).features() for index in range(len(self.steps))))
        return serving | {"serving_tp", f"tp{self.tp_size}"} | ({"fully_sharded"} if self.layer.fully_sharded else set())


def is_tp_serving_json(data: dict) -> bool:
    """Whether a serving case's JSON is a tensor-parallel one (its layer has a TP size)."""
    return isinstance(data, dict) and isinstance(data.get("layer"), dict) and "tp_size" in data["layer"]
