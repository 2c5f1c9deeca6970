"""Judging a tensor-parallel case: the gathered output against the unsharded float64 reference.

* oracle: the golden reference's ``add_lora_linear`` on the *unsharded* layer in float64
  (``PunicaWrapperReference``, one call on the full stacks);
* baseline: the same tensor-parallel composition (``conformance.tp.composition``) run by the reference
  in the case dtype, every rank a thread, the collectives summing in the dtype: the partial sums and
  roundings a correct target may show;
* the unsharded layer's delta and magnitude in float64, so the systematic-error rule and the
  budget's scale read a layer as they read an op case;
* ``conformance.verdict.judge`` decides, with every row of an adapter written and every row of slot
  −1 untouched in value (a zero whose sign flipped there is recorded, and said in the message of a
  pass, not failed). A failure names the rows by slot and the columns by the rank that owns them.
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

from .case import TPCase
from .collectives import run_in_threads
from .composition import run_rank
from .moe_case import MoETPCase
from .moe_judgement import judge_moe_output
from .values import LayerTensors, column_ranges, in_replica, layer_tensors, rank_columns, replica_sources


def oracle_output(case: TPCase, tensors: LayerTensors) -> torch.Tensor:
    """The unsharded layer's output in float64."""
    exact = tensors.to(torch.float64)
    reference = PunicaWrapperReference()
    reference.update_metadata(case_mapping(case))
    y = exact.y.clone()
    reference.add_lora_linear(y, exact.x, exact.lora_a, exact.lora_b, case.scale, case.output_slices)
    return y


def oracle_delta(case: TPCase, tensors: LayerTensors) -> torch.Tensor:
    """What the unsharded layer adds, in float64 (the output zeroed): the verdict's systematic-error rule
    fits the error against it, as ``conformance.runner.oracle_delta`` does for op cases."""
    return oracle_output(case, replace(tensors, y=torch.zeros_like(tensors.y)))


def oracle_magnitude(case: TPCase, tensors: LayerTensors) -> torch.Tensor:
    """``|y| + |x|·|A|·|B|`` in float64: the size of the terms each output element sums, in whose ulps the
    budget allows float32 accumulation error (``conformance.runner.oracle_magnitude``)."""
    return oracle_output(case, tensors.map(torch.abs))


def baseline_output(case: TPCase, tensors: LayerTensors) -> torch.Tensor:
    """The composition run by the reference in the case dtype, the ranks as threads of this process:
    ``[replica_groups, T, Σ N_s]``, as ``composition.run_rank`` gives it."""
    def one_rank(rank: int, collectives) -> torch.Tensor:
        reference = PunicaWrapperReference()
        reference.update_metadata(case_mapping(case))
        return run_rank(case, tensors, reference, collectives, rank, torch.device("cpu"))

    return run_in_threads(case.tp_size, one_rank)[0]


def written_mask(case: TPCase) -> torch.Tensor:
    """Every column of every row with an adapter; rows of slot −1 must stay as they were."""
    rows = torch.tensor([slot != -1 for slot in case.token_slots])
    return rows[:, None].expand(case.num_tokens, case.output_width).clone()


def _column_owners(case: TPCase, replica: int) -> list[tuple[int, int, int, int]]:
    """``(rank, slice, start, end)`` of every rank's columns in replica group ``replica``'s output."""
    return [
        (rank, s, start, end)
        for rank in range(case.tp_size)
        for s, (start, end) in enumerate(rank_columns(case, rank))
        if in_replica(case, s, rank, replica)
    ]


def describe_columns(case: TPCase, columns: tuple[int, ...], limit: int = 6, replica: int = 0) -> str:
    """"columns 8–15 (slice 1, rank 1)": which slice each column is in, and which rank's shard computes it
    (in replica group ``replica``'s output, where ranks share kv heads)."""
    if case.layer == "row" and not case.fully_sharded:
        return f"columns {column_ranges(columns, limit)} (every rank adds a partial delta to every column)"
    owner: dict[tuple[int, int], list[int]] = {}  # (rank, slice) → columns
    for column in columns:
        for rank, s, start, end in _column_owners(case, replica):
            if start <= column < end:
                owner.setdefault((rank, s), []).append(column)
    parts = []
    for (rank, s), cols in sorted(owner.items()):
        name = f" ({case.slice_name(s)})" if case.layer == "qkv_indexer" else ""
        where = f"slice {s}{name}, rank {rank}" if case.num_slices > 1 else f"rank {rank}"
        parts.append(f"columns {column_ranges(cols, limit)} ({where})")
    return "; ".join(parts)


def failing_ranks(case: TPCase, columns: tuple[int, ...], replica: int = 0) -> tuple[int, ...]:
    """The ranks whose columns show a problem (every rank for a row layer that is not fully sharded)."""
    if case.layer == "row" and not case.fully_sharded:
        return tuple(range(case.tp_size)) if columns else ()
    return tuple(sorted({rank for rank, _, start, end in _column_owners(case, replica) if any(start <= c < end for c in columns)}))


def judge_output(case: TPCase, actual: torch.Tensor, tensors: LayerTensors | None = None):
    """``(verdict, message, failing_slots, failing_ranks, kinds, outside_zeroed)`` for the gathered ``actual``
    (``[replica_groups, T, Σ N_s]``): every replica group's output is judged; the verdict returned is the
    first failing one's (else the first's), the message, slots, ranks and kinds cover them all (a pass's
    message says what differs in bits only, if anything). ``outside_zeroed``, as an op result's: where the
    layer changed elements it must leave as they were (rows without an adapter), whether every one is now
    zero in every group (None where it changed none). An MoE
    case is judged by ``conformance.tp.moe_layer.judge_moe_output``."""
    if isinstance(case, MoETPCase):
        return judge_moe_output(case, actual, tensors)
    tensors = tensors or layer_tensors(case)
    oracle, baseline = oracle_output(case, tensors), baseline_output(case, tensors)
    delta, magnitude, written = oracle_delta(case, tensors), oracle_magnitude(case, tensors), written_mask(case)
    verdicts = [judge(actual[j], oracle, baseline[j], tensors.y, written, delta, magnitude) for j in range(case.replica_groups)]
    failing = [(j, verdict) for j, verdict in enumerate(verdicts) if not verdict.passed]
    if not failing:
        notes = [(f"replica group {j}: " if case.replica_groups > 1 else "") + note for j, verdict in enumerate(verdicts)
                 for note in bit_level_notes(verdict.measurement.bit_differences, lambda rows: describe_rows(rows, case.token_slots))]
        return verdicts[0], "; ".join(notes), (), (), (), None
    row_slots = case.token_slots
    details, slots, ranks, kinds = [], set(), set(), []
    for j, verdict in failing:
        group = f"replica group {j} ({replica_sources(case, j)}): " if case.replica_groups > 1 else ""
        for problem in verdict.problems:
            where = [describe_rows(problem.rows, row_slots)] if problem.rows else []
            where += [describe_columns(case, problem.columns, replica=j)] if problem.columns else []
            details.append(group + (f"{problem.text}: {'; '.join(where)}" if where else problem.text))
            kinds.append(problem.kind)
        slots |= {row_slots[row] for p in verdict.problems for row in p.rows}
        ranks |= set(failing_ranks(case, tuple(c for p in verdict.problems for c in p.columns), j))
    zeroed = [p.zeroed for _, verdict in failing for p in verdict.problems if p.kind is FailureKind.OUTSIDE_REGION]
    return failing[0][1], "; ".join(details), tuple(sorted(slots)), tuple(sorted(ranks)), ordered(kinds), all(zeroed) if zeroed else None
