"""What an op is, as data: the OpInfo of this suite.

An :class:`OpSpec` says which level an op belongs to, which case knobs it reads (so the generator
leaves the others at their defaults), which edge-case families apply, how to fill its tensors, how
to call it, which tensor it writes and which elements it may write, and which function of the golden
reference computes it. The generic runner consumes these; nothing here knows a target.

An op is one spec plus its reference module: the op lists (``conformance.ops.ops_at``), the
``reference`` target and ``describe`` all derive from the registered specs (``conformance.ops.register``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conformance.cases.case import Case

from .level import Level

Tensors = dict[str, torch.Tensor]

# The knobs a case can turn; an op lists those it reads.
KNOBS = frozenset({
    "slices", "offset", "wide", "add_inputs", "scale", "expand_input", "bias", "hidden", "prefill",
    "w4d",  # the dense stacks' legacy layout [L, 1, rows, cols]
    # the fused-MoE ops (conformance.ops.moe): the routing itself, gate/up as two slices or one fused,
    # mul_routed_weight drawn both ways, the kernels' block size and naive block assignment
    "routing", "gate_up", "routed_weight", "blocks", "naive",
    # apply_lora_full_linear: slots whose full-linear module is disabled (Case.disabled_slots)
    "module_enabled",
    # the sgmv ops: segments anywhere in the rows (Case.seq_starts, Case.num_rows), not only back to back
    "segments",
})  # fmt: skip


@dataclass(frozen=True)
class OpCall:
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class OpSpec:
    name: str
    level: Level
    summary: str
    knobs: frozenset[str]
    make_values: Callable[[Case, torch.Generator], Tensors]
    make_call: Callable[[Case, Tensors, torch.device], OpCall]
    written_mask: Callable[[Case], torch.Tensor]  # bool, shape of the output
    # The golden reference: a kernel op's function (called with the op's arguments), or a wrapper
    # op's method of conformance.reference.PunicaWrapperReference (called on a wrapper that holds
    # the mapping, as ``reference(wrapper, *args)``).
    reference: Callable
    output: str = "out"
    max_slices: int = 1
    # What the output's rows are: "tokens", "sampled" rows (logits) or "pairs" (t·top_k + k, the MoE ops).
    rows: str = "tokens"
    # An op whose correct outputs are many (moe_lora_align_block_size) is judged by its invariants
    # instead of against the oracle: ``check(case, after, values)`` lists the problems as
    # ``(row, text)`` pairs, empty when the output is correct; it may write the outputs named in
    # ``extra_outputs`` besides ``output``.
    check: Callable[[Case, Tensors, Tensors], list[tuple[int, str]]] | None = None
    extra_outputs: tuple[str, ...] = ()
    # MoE ops: the routing weight is always applied (w2: True), never (w13: False), or drawn (the
    # "routed_weight" knob); None for the other ops.
    routed_weight: bool | None = None

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every tensor the op writes; all others are read-only."""
        return (self.output, *self.extra_outputs)

    def row_slots(self, case: Case) -> tuple[int, ...]:
        """The adapter slot of each row of the output."""
        return {"tokens": case.token_slots, "sampled": case.sampled_slots, "pairs": case.pair_slots}[self.rows]

    def __post_init__(self) -> None:
        unknown = self.knobs - KNOBS
        if unknown:
            raise ValueError(f"op {self.name}: unknown knobs {sorted(unknown)}")
        if self.level not in (Level.KERNEL, Level.WRAPPER):
            raise ValueError(f"op {self.name}: an op case is at level kernel or wrapper, not {self.level}")
        if self.rows not in ("tokens", "sampled", "pairs"):
            raise ValueError(f"op {self.name}: rows must be tokens, sampled or pairs, not {self.rows!r}")
        if not callable(self.reference):
            raise ValueError(f"op {self.name}: its reference must be a function of conformance.reference")


def row_mask(slots: tuple[int, ...]) -> torch.Tensor:
    """True for rows that use an adapter."""
    return torch.tensor([s != -1 for s in slots], dtype=torch.bool)


def rows_and_columns(slots: tuple[int, ...], width: int, first: int, last: int) -> torch.Tensor:
    """``[rows, width]`` mask: adapter rows × columns ``[first, last)``."""
    columns = torch.zeros(width, dtype=torch.bool)
    columns[first:last] = True
    return row_mask(slots)[:, None] & columns[None, :]
