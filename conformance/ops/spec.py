"""What an op is, as data: the OpInfo of this suite.

An :class:`OpSpec` says which level an op belongs to, which case knobs it reads (so the generator
leaves the others at their defaults), which edge-case families apply, how to fill its tensors, how
to call it, which tensor it writes and which elements it may write. The generic runner consumes
these; nothing here knows a target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conformance.cases.case import Case

Tensors = dict[str, torch.Tensor]

# The knobs a case can turn; an op lists those it reads.
KNOBS = frozenset({"slices", "offset", "wide", "add_inputs", "scale", "expand_input", "bias", "hidden", "prefill"})


@dataclass(frozen=True)
class OpCall:
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class OpSpec:
    name: str
    level: str  # "kernel" or "wrapper"
    summary: str
    knobs: frozenset[str]
    make_values: Callable[[Case, torch.Generator], Tensors]
    make_call: Callable[[Case, Tensors, torch.device], OpCall]
    written_mask: Callable[[Case], torch.Tensor]  # bool, shape of the output
    output: str = "out"
    max_slices: int = 1
    rows_are_sampled: bool = False  # output rows are sampled rows (logits), not tokens

    def row_slots(self, case: Case) -> tuple[int, ...]:
        """The adapter slot of each row of the output."""
        return case.sampled_slots if self.rows_are_sampled else case.token_slots

    def __post_init__(self) -> None:
        unknown = self.knobs - KNOBS
        if unknown:
            raise ValueError(f"op {self.name}: unknown knobs {sorted(unknown)}")
        if self.level not in ("kernel", "wrapper"):
            raise ValueError(f"op {self.name}: level must be kernel or wrapper")


def row_mask(slots: tuple[int, ...]) -> torch.Tensor:
    """True for rows that use an adapter."""
    return torch.tensor([s != -1 for s in slots], dtype=torch.bool)


def rows_and_columns(slots: tuple[int, ...], width: int, first: int, last: int) -> torch.Tensor:
    """``[rows, width]`` mask: adapter rows × columns ``[first, last)``."""
    columns = torch.zeros(width, dtype=torch.bool)
    columns[first:last] = True
    return row_mask(slots)[:, None] & columns[None, :]
