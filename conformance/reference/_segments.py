"""Checks shared by the sgmv ops: their per-segment metadata must describe the inputs.

Segment ``b`` is rows ``[b_seq_start_loc[b], b_seq_start_loc[b] + seq_len_tensor[b])``; the starts are read,
never derived from the lengths, so segments may come in any order and leave rows uncovered.
"""

from __future__ import annotations

import torch


def check_segments(
    inputs: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
) -> None:
    """Raise ``ValueError`` naming the inconsistent argument (vLLM's kernels assert the same)."""
    if inputs.size(0) != token_nums:
        raise ValueError(f"token_nums is {token_nums} but inputs have {inputs.size(0)} rows")
    for name, tensor in (
        ("b_seq_start_loc", b_seq_start_loc),
        ("seq_len_tensor", seq_len_tensor),
        ("lora_indices_tensor", lora_indices_tensor),
    ):
        if tensor.numel() != batches:
            raise ValueError(f"{name} has {tensor.numel()} entries but batches is {batches}")
    if batches and int(seq_len_tensor.max()) > max_seq_length:
        raise ValueError(f"a segment of {int(seq_len_tensor.max())} rows exceeds max_seq_length {max_seq_length}")
    # Segments may lie anywhere in the rows and in any order, with rows between them that no segment
    # covers, but each must lie inside the rows and no row may belong to two of them.
    segments = sorted(zip(b_seq_start_loc.tolist(), seq_len_tensor.tolist()))
    for start, length in segments:
        if start < 0 or length < 0 or start + length > token_nums:
            raise ValueError(
                f"the segment at row {start} of {length} rows lies outside the {token_nums} rows (b_seq_start_loc, seq_len_tensor)"
            )
    for (start, length), (next_start, _) in zip(segments, segments[1:]):
        if next_start < start + length:
            raise ValueError(f"the segments at rows {start} and {next_start} overlap (b_seq_start_loc, seq_len_tensor)")
