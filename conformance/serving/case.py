"""A serving case: one target instance, built once, driven step after step as vLLM's model runner drives it.

A case fixes what a server fixes at start-up (the capacity: slots, max rank, max batched tokens, the
captured batch sizes and adapter counts) and lists its steps. Each step is one forward pass of one
LoRA layer: the adapters resident in the slots (loaded in place, evicted by being overwritten), the real
batch (sequences, their adapters, prefill or decode), how many rows the layer gets (the captured size the
batch is padded to, or the real count when it runs eagerly) and how it runs:

* ``capture``: the runner's dummy batch for one graph key, all rows real, recorded with the target's
  ``capture`` and then replayed once; judged like every step;
* ``replay``: a real batch padded up to the graph's size and run by replaying that graph; rows past the
  real ones carry what earlier steps left in the persistent buffers;
* ``eager``: a batch larger than every captured size (or a logits step), run unpadded and uncaptured.

Every step's real rows are judged against the float64 oracle of the same batch as an op case
(:meth:`ServingCase.step_case`), so the serving level adds no numerics of its own: it adds the state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from conformance.cases.case import SHORT_DTYPE, Case
from conformance.query import case_id

MODES = ("capture", "replay", "eager")
# How the runner keys its graphs (docs/serving.md): vLLM with cudagraph_specialize_lora (one graph per batch
# size and rounded count of active adapters), vLLM without it (none or max_loras + 1), vllm-gaudi and SGLang
# (one graph per size, captured with no adapter active, replayed with any).
GRAPH_POLICIES = ("per_count", "max_count", "no_adapters")


@dataclass(frozen=True)
class ServingStep:
    mode: str  # one of MODES
    seq_lens: tuple[int, ...]  # real tokens per sequence
    seq_adapters: tuple[int, ...]  # adapter of each sequence (an index into the case's adapter pool), −1 = none
    is_prefill: bool
    resident: tuple[int, ...]  # the adapter whose weights each slot holds at this step, −1 = never loaded
    rows: int  # rows the layer gets: the graph's size (capture, replay) or the real tokens (eager)
    graph: int = -1  # the graph (index into ServingCase.graphs) captured or replayed; −1 eager

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def seq_slots(self) -> tuple[int, ...]:
        """The slot of each sequence: where its adapter is resident."""
        return tuple(-1 if adapter < 0 else self.resident.index(adapter) for adapter in self.seq_adapters)

    @property
    def active_adapters(self) -> int:
        """Distinct adapters of the batch (base requests do not count, as vLLM counts them)."""
        return len({adapter for adapter in self.seq_adapters if adapter >= 0})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ServingStep:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


class ServedSequence:
    """What every serving case's record shares: a family, a layer (its own case type, ``layer_type``), an adapter pool,
    capacities, a graph policy, the captured keys, the steps and a seed; written to and read from JSON alike."""

    layer_type: ClassVar[type]  # the layer's case type (its from_json reads the "layer" field)
    what: ClassVar[str]  # how an error names the record

    @property
    def op(self) -> str:
        return self.layer.op

    @property
    def dtype(self) -> str:
        return self.layer.dtype

    def to_json(self) -> dict:
        return {"family": self.family, "layer": self.layer.to_json(), "adapter_ranks": list(self.adapter_ranks),
                "max_tokens": self.max_tokens, "graph_policy": self.graph_policy, "graphs": [list(g) for g in self.graphs],
                "steps": [step.to_json() for step in self.steps], "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict):
        try:
            return cls(data["family"], cls.layer_type.from_json(data["layer"]), tuple(data["adapter_ranks"]), data["max_tokens"],
                       data["graph_policy"], tuple(tuple(g) for g in data["graphs"]),
                       tuple(ServingStep.from_json(step) for step in data["steps"]), data["seed"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a {cls.what}: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class ServingCase(ServedSequence):
    family: str  # the scenario (conformance.serving.scenarios.SCENARIOS)
    layer: Case  # the layer's shape and dtype as an op case (op, dtype, slots, max rank, sizes, scale, MoE routing size)
    adapter_ranks: tuple[int, ...]  # the adapter pool: more adapters than slots, so steps load and evict
    max_tokens: int  # max_num_batched_tokens: the persistent buffers' rows
    graph_policy: str  # one of GRAPH_POLICIES
    graphs: tuple[tuple[int, int], ...]  # the captured keys: (batch size, adapter count)
    steps: tuple[ServingStep, ...]
    seed: int
    layer_type: ClassVar[type] = Case
    what: ClassVar[str] = "serving case"

    def __post_init__(self) -> None:
        problems = sequence_problems(self.graph_policy, self.graphs, self.steps, self.layer.num_slots, self.max_tokens)
        if problems:
            raise ValueError("invalid serving case: " + "; ".join(problems))

    @property
    def case_id(self) -> str:
        return case_id("serving", self.family, {"op": self.op, "dtype": SHORT_DTYPE[self.layer.dtype], "graphs": self.graph_policy,
                                                "steps": len(self.steps), "seed": self.seed})

    def step_case(self, index: int) -> Case:
        """Step ``index``'s real batch as an op case: what the oracle computes and the verdict judges."""
        step = self.steps[index]
        ranks = tuple(self.adapter_ranks[adapter] if adapter >= 0 else 1 for adapter in step.resident)
        return dataclasses.replace(
            self.layer, seq_lens=step.seq_lens, seq_slots=step.seq_slots, adapter_ranks=ranks, is_prefill=step.is_prefill,
            seed=self.seed * 1000 + index, topk_ids=self.routing(index), num_rows=0, seq_starts=(),
        )

    def routing(self, index: int) -> tuple[tuple[int, ...], ...]:
        """An MoE step's routing: ``max_tokens`` tokens' choices are drawn once (``layer.topk_ids``); step ``index``
        routes its tokens as a window of them that moves from step to step."""
        if not self.layer.top_k:
            return ()
        start = (7 * index) % self.max_tokens
        rolled = self.layer.topk_ids[start:] + self.layer.topk_ids[:start]
        return rolled[: self.steps[index].num_tokens]

    def features(self) -> frozenset[str]:
        return sequence_features(self.family, self.graph_policy, self.steps)


def sequence_problems(graph_policy: str, graphs: tuple[tuple[int, int], ...], steps: tuple[ServingStep, ...], num_slots: int,
                      max_tokens: int) -> list[str]:
    """What is wrong with a sequence of steps served with ``num_slots`` slots and ``max_tokens`` rows (any layer's)."""
    problems = []
    if graph_policy not in GRAPH_POLICIES:
        problems.append(f"graph_policy {graph_policy!r} is not one of {GRAPH_POLICIES}")
    for index, step in enumerate(steps):
        where = f"step {index}"
        if step.mode not in MODES:
            problems.append(f"{where}: mode {step.mode!r} is not one of {MODES}")
        if len(step.resident) != num_slots:
            problems.append(f"{where}: {len(step.resident)} resident entries for {num_slots} slots")
        if any(adapter >= 0 and adapter not in step.resident for adapter in step.seq_adapters):
            problems.append(f"{where}: a sequence's adapter is not resident")
        if step.rows < step.num_tokens or step.rows > max_tokens:
            problems.append(f"{where}: {step.rows} rows for {step.num_tokens} tokens (capacity {max_tokens})")
        if (step.mode == "eager") != (step.graph < 0) or step.graph >= len(graphs):
            problems.append(f"{where}: a {step.mode} step names graph {step.graph}")
        elif step.graph >= 0 and graphs[step.graph][0] != step.rows:
            problems.append(f"{where}: graph {step.graph} is of size {graphs[step.graph][0]}, the step has {step.rows} rows")
    return problems


def sequence_features(family: str, graph_policy: str, steps: tuple[ServingStep, ...]) -> frozenset[str]:
    """The serving features of a sequence: its family, graph policy, step modes, padding, prefill beside decode."""
    modes = {step.mode for step in steps}
    found = {"serving", f"serving_{family}", f"graphs_{graph_policy}", *(f"step_{m}" for m in modes)}
    if any(step.rows > step.num_tokens for step in steps):
        found.add("padded_rows")
    if len({step.is_prefill for step in steps}) > 1:
        found.add("prefill_and_decode")
    return frozenset(found)
