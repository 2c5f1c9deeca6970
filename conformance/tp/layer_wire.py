"""What crosses between the referee and a tensor-parallel rank for one case, as data (``conformance.wire``).

The referee sends :func:`request` (the case's JSON and which kind of layer it is); each rank answers a
:class:`RankAnswer`: rank 0 the gathered output, every rank the inputs its wrapper calls modified and
those handed back with equal values and other bits. :func:`read_answer` is the referee's reading of an
answer: built from the declared types alone, rank 0's output bounded by what the case can produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.verdict.bit_differences import BitDifferences
from conformance.wire import Limits, WireError, from_data

from .case import TPCase
from .moe_case import MoETPCase

REPLY_SLACK = 1 << 20


@dataclass(frozen=True)
class RankAnswer:
    output: torch.Tensor | None  # rank 0: the unsharded output of each replica group; the others: None
    modified: tuple[str, ...] = ()  # "add_expand modified its input 'x'", in call order
    bit_level: tuple[BitDifferences, ...] = ()


def request(case: TPCase | MoETPCase) -> dict:
    return {"case": case.to_json(), "moe": isinstance(case, MoETPCase)}


def case_from_request(data: dict) -> TPCase | MoETPCase:
    """The rank's reading of :func:`request` (from its parent: trusted, still checked by the case's own from_json)."""
    return (MoETPCase if data["moe"] else TPCase).from_json(data["case"])


def answer_limits(case: TPCase | MoETPCase) -> Limits:
    """What one rank's answer may carry: at most twice the output the case gathers, in float64."""
    if isinstance(case, MoETPCase):
        elements = case.num_pairs * case.judged_width
    else:
        elements = case.replica_groups * case.num_tokens * case.output_width
    return Limits(tensor_bytes=2 * 8 * elements + REPLY_SLACK, tensors=1)


def read_answer(data, rank: int) -> RankAnswer:
    """``WireError`` naming what is wrong with a rank's answer, else the answer."""
    answer = from_data(RankAnswer, data, f"rank {rank}'s answer")
    if (answer.output is None) != (rank != 0):
        raise WireError(f"rank {rank}'s answer {'lacks' if rank == 0 else 'holds'} the gathered output (rank 0, and only rank 0, sends it)")
    return answer
