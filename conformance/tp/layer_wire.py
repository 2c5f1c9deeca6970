"""What crosses between the referee and a tensor-parallel rank for one case, as data (``conformance.wire``).

The referee sends :func:`request` (the case's JSON, which kind of layer it is, and the unsharded tensors it
drew from the case's seed: ranks draw nothing, since they run the target's code); each rank answers a
:class:`RankAnswer`: rank 0 the gathered output, every rank the inputs its wrapper calls modified and
those handed back with equal values and other bits. :func:`read_answer` is the referee's reading of an
answer: built from the declared types alone, rank 0's output bounded by what the case can produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.verdict.bit_differences import BitDifferences
from conformance.wire import Limits, WireError, from_data, to_data

from .case import TPCase
from .moe_case import MoETPCase
from .moe_layer import MoETensors
from .values import LayerTensors

REPLY_SLACK = 1 << 20


@dataclass(frozen=True)
class RankAnswer:
    output: torch.Tensor | None  # rank 0: the unsharded output of each replica group; the others: None
    modified: tuple[str, ...] = ()  # "add_expand modified its input 'x'", in call order
    bit_level: tuple[BitDifferences, ...] = ()


def request(case: TPCase | MoETPCase, tensors: LayerTensors | MoETensors) -> dict:
    return {"case": case.to_json(), "moe": isinstance(case, MoETPCase), "tensors": to_data(tensors)}


def read_request(data: dict) -> tuple[TPCase | MoETPCase, LayerTensors | MoETensors]:
    """The rank's reading of :func:`request`: the case and its tensors (from its parent: trusted, still checked by
    the case's own from_json and the tensors' declared types)."""
    moe = data["moe"]
    case = (MoETPCase if moe else TPCase).from_json(data["case"])
    return case, from_data(MoETensors if moe else LayerTensors, data["tensors"], "the case's tensors")


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
