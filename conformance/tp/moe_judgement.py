"""Judging a tensor-parallel MoE LoRA case: the joined output against the unsharded float64 reference.

As for the linear layers (``conformance.tp.judgement``): the oracle is the golden reference's
``add_lora_w13`` / ``add_lora_w2`` on the whole (unsharded, unpadded) stacks in float64; the baseline
is the composition of ``conformance.tp.moe_layer`` run by the reference in the case dtype, every rank
a thread; the delta and the magnitude are the unsharded layer's in float64. The written region is
every unsharded column of every pair whose slot has an enabled adapter; the padding columns of a
padded rank (w13) and the pairs of slot −1 or of a disabled slot must come back with their values (a
zero whose sign flipped there is recorded, and said in the message of a pass, not failed).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from conformance.ops import case_mapping
from conformance.reference.punica_wrapper import PunicaWrapperReference
from conformance.runner import describe_rows
from conformance.verdict import judge
from conformance.verdict.bit_differences import bit_level_notes
from conformance.verdict.failure_kind import FailureKind, ordered

from .collectives import run_in_threads
from .moe_case import MoETPCase
from .moe_layer import MoETensors, moe_composition, moe_tensors, w13_columns
from .values import column_ranges


def moe_oracle_output(case: MoETPCase, tensors: MoETensors) -> torch.Tensor:
    """The unsharded layer's judged output in float64: the reference's ``add_lora_w13`` / ``add_lora_w2`` on the
    whole stacks into the ``output_width`` unsharded columns; the padding columns stay as they were."""
    exact = tensors.to(torch.float64)
    reference = PunicaWrapperReference()
    reference.update_metadata(case_mapping(case))
    method = reference.add_lora_w13 if case.layer == "moe_w13" else reference.add_lora_w2
    out = exact.y.clone()
    head = out[:, : case.output_width].clone()
    method(head.view(case.num_tokens, case.top_k, -1), exact.x, exact.lora_a, exact.lora_b, exact.topk_ids,
           exact.topk_weights, exact.adapter_enabled)
    out[:, : case.output_width] = head
    return out


def moe_baseline_output(case: MoETPCase, tensors: MoETensors) -> torch.Tensor:
    """The composition run by the reference in the case dtype, the ranks as threads: ``[1, T·top_k, judged]``."""
    def one_rank(rank: int, collectives) -> torch.Tensor:
        reference = PunicaWrapperReference()
        reference.update_metadata(case_mapping(case))
        return moe_composition(case)(case, tensors, reference, collectives, rank)

    return run_in_threads(case.tp_size, one_rank)[0]


def moe_written_mask(case: MoETPCase) -> torch.Tensor:
    """The unsharded columns of every pair whose slot has an enabled adapter; pairs of slot −1 or of a
    disabled slot, and every padding column, must stay as they were."""
    disabled = set(case.disabled_slots)
    rows = torch.tensor([slot != -1 and slot not in disabled for slot in case.pair_slots])
    columns = torch.arange(case.judged_width) < case.output_width
    return rows[:, None] & columns[None, :]


def _owners(case: MoETPCase) -> list[tuple[int, str, int, int]]:
    """``(rank, part, start, end)`` of every w13 column; w2's columns are every rank's (a partial sum each)."""
    return [(rank, part, start, end) for rank in range(case.tp_size) for part, start, end in w13_columns(case, rank)]


def describe_moe_columns(case: MoETPCase, columns: tuple[int, ...], limit: int = 6) -> str:
    """"columns 8–11 (up, rank 1)": which part of w13 each column is in and which rank computes it."""
    if case.layer == "moe_w2":
        return f"columns {column_ranges(columns, limit)} (every rank adds a partial delta to every column)"
    found: dict[tuple[int, str], list[int]] = {}
    for column in columns:
        for rank, part, start, end in _owners(case):
            if start <= column < end:
                found.setdefault((rank, part), []).append(column)
    return "; ".join(f"columns {column_ranges(cols, limit)} ({part}, rank {rank})" for (rank, part), cols in sorted(found.items()))


def moe_failing_ranks(case: MoETPCase, columns: tuple[int, ...]) -> tuple[int, ...]:
    if case.layer == "moe_w2":
        return tuple(range(case.tp_size)) if columns else ()
    return tuple(sorted({rank for rank, _, start, end in _owners(case) if any(start <= c < end for c in columns)}))


def judge_moe_output(case: MoETPCase, actual: torch.Tensor, tensors: MoETensors | None = None):
    """``(verdict, message, failing_slots, failing_ranks, kinds, outside_zeroed)`` for the joined ``actual``
    ``[1, T·top_k, judged]`` (``outside_zeroed`` as ``conformance.tp.judgement.judge_output``'s)."""
    tensors = tensors or moe_tensors(case)
    oracle, baseline = moe_oracle_output(case, tensors), moe_baseline_output(case, tensors)
    delta = moe_oracle_output(case, replace(tensors, y=torch.zeros_like(tensors.y)))
    magnitude = moe_oracle_output(case, tensors.map(torch.abs))
    verdict = judge(actual[0], oracle, baseline[0], tensors.y, moe_written_mask(case), delta, magnitude)
    if verdict.passed:
        notes = bit_level_notes(verdict.measurement.bit_differences, lambda rows: describe_rows(rows, case.pair_slots))
        return verdict, "; ".join(notes), (), (), (), None
    row_slots = case.pair_slots
    details, kinds = [], []
    for problem in verdict.problems:
        where = [describe_rows(problem.rows, row_slots)] if problem.rows else []
        where += [describe_moe_columns(case, problem.columns)] if problem.columns else []
        details.append(f"{problem.text}: {'; '.join(where)}" if where else problem.text)
        kinds.append(problem.kind)
    slots = tuple(sorted({row_slots[row] for p in verdict.problems for row in p.rows}))
    ranks = moe_failing_ranks(case, tuple(c for p in verdict.problems for c in p.columns))
    zeroed = next((p.zeroed for p in verdict.problems if p.kind is FailureKind.OUTSIDE_REGION), None)
    return verdict, "; ".join(details), slots, ranks, ordered(kinds), zeroed
