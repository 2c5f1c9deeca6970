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
from .serving_case import TPServingCase
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


# -- serving: one request runs a whole sequence of steps on every rank (conformance.tp.serving_rank) ---------------


@dataclass(frozen=True)
class RankServed:
    """One rank's answer to a serving case: after every step, its persistent shard buffers (``x``, ``y``,
    ``lora_a.<slice>``, ``lora_b.<slice>``); rank 0 also each step's gathered real rows, served (``outputs``) and
    the same batch called fresh (``fresh``), ``[replica_groups, T, Σ N_s]``; the rows its layer got per step;
    how it ran them (``graphs``, in words)."""

    states: list[dict[str, torch.Tensor]]
    outputs: list[torch.Tensor]
    fresh: list[torch.Tensor]
    rows: list[int]
    graphs: str


def serving_request(case: TPServingCase, initial: LayerTensors, steps: list[LayerTensors]) -> dict:
    return {"serving": True, "case": case.to_json(), "initial": to_data(initial), "steps": to_data(steps)}


def read_serving_request(data: dict) -> tuple[TPServingCase, LayerTensors, list[LayerTensors]]:
    """The rank's reading of :func:`serving_request` (from its parent: trusted, still typed)."""
    return (TPServingCase.from_json(data["case"]), from_data(LayerTensors, data["initial"], "the initial buffers"),
            from_data(list[LayerTensors], data["steps"], "the steps' tensors"))


def serving_limits(case: TPServingCase, initial: LayerTensors) -> Limits:
    """What one rank's answer may carry: its whole state after every step and rank 0's two outputs per step,
    each at most the unsharded size in float64, twice over."""
    state = sum(t.numel() for t in (initial.x, initial.y, *initial.lora_a, *initial.lora_b))
    outputs = 2 * case.layer.replica_groups * case.max_tokens * case.layer.output_width
    steps = len(case.steps)
    return Limits(tensor_bytes=2 * 8 * steps * (state + outputs) + REPLY_SLACK, tensors=steps * (4 + 2 * len(initial.lora_a)))


def read_served(data, rank: int, case: TPServingCase) -> RankServed:
    """``WireError`` naming what is wrong with a rank's serving answer, else the answer."""
    served = from_data(RankServed, data, f"rank {rank}'s serving answer")
    steps = len(case.steps)
    outputs = steps if rank == 0 else 0
    if len(served.states) != steps or len(served.rows) != steps or len(served.outputs) != outputs or len(served.fresh) != outputs:
        raise WireError(f"rank {rank}'s serving answer holds {len(served.states)} state(s), {len(served.rows)} row count(s), "
                        f"{len(served.outputs)} served and {len(served.fresh)} fresh output(s); a case of {steps} step(s) "
                        f"gets {steps}, {steps}, {outputs} and {outputs} (outputs from rank 0 only)")
    for step, rows in zip(case.steps, served.rows):
        if rows not in (step.rows, step.num_tokens):
            raise WireError(f"rank {rank} says a step of {step.num_tokens} token(s) padded to {step.rows} ran on {rows} rows")
    return served
