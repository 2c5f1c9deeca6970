"""What a batch looks like to the LoRA wrapper: which adapter slot each token and each sampled row uses.

vLLM's ``LoRAMapping`` carries adapter *ids* (0 = none) and the wrapper turns them into *slots*
(positions in the stacks, −1 = none) with ``lora_index_to_id``. The suite speaks in slots directly;
targets that wrap vLLM translate back (slot ``l`` ↔ id ``l + 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """The adapter layout of one batch.

    ``token_slots``: slot per token (−1 = no adapter), tokens of each sequence contiguous.
    ``sampled_slots``: slot per sampled row (the rows the logits op sees; one per sequence here).
    ``seq_lens``: tokens per sequence, summing to ``len(token_slots)``.
    ``is_prefill``: prefill batch (vLLM's CPU wrapper then uses sgmv) or decode batch (bgmv).
    ``num_slots``: how many adapter slots the stacks hold (vLLM's ``max_loras``).
    """

    token_slots: tuple[int, ...]
    sampled_slots: tuple[int, ...]
    seq_lens: tuple[int, ...]
    is_prefill: bool
    num_slots: int

    def __post_init__(self) -> None:
        if sum(self.seq_lens) != len(self.token_slots):
            raise ValueError(f"seq_lens sum to {sum(self.seq_lens)} but there are {len(self.token_slots)} token slots")
        for name in ("token_slots", "sampled_slots"):
            bad = [s for s in getattr(self, name) if not -1 <= s < self.num_slots]
            if bad:
                raise ValueError(f"{name} holds {bad}, outside [-1, {self.num_slots - 1}]")

    def token_slot_tensor(self) -> torch.Tensor:
        return torch.tensor(self.token_slots, dtype=torch.long)

    def sampled_slot_tensor(self) -> torch.Tensor:
        return torch.tensor(self.sampled_slots, dtype=torch.long)


@dataclass(frozen=True)
class SegmentMetadata:
    """sgmv metadata: runs of consecutive tokens with the same slot (vLLM's ``compute_meta``).

    Runs are merged across sequence boundaries, as vLLM does: segments follow slots, not requests.
    """

    b_seq_start_loc: torch.Tensor
    seq_len_tensor: torch.Tensor
    lora_indices_tensor: torch.Tensor
    batches: int
    max_seq_length: int
    token_nums: int
    no_lora: bool

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> SegmentMetadata:
        slots, lengths = torch.unique_consecutive(token_slots.reshape(-1).long(), return_counts=True)
        starts = torch.zeros_like(lengths)
        starts[1:] = torch.cumsum(lengths, 0)[:-1]
        return cls(
            b_seq_start_loc=starts,
            seq_len_tensor=lengths,
            lora_indices_tensor=slots,
            batches=slots.numel(),
            max_seq_length=int(lengths.max()) if lengths.numel() else 0,
            token_nums=int(lengths.sum()),
            no_lora=bool((slots == -1).all()),
        )

    def args(self) -> tuple:
        """The sgmv arguments after the output tensor, in vLLM's order."""
        return (
            self.b_seq_start_loc,
            self.seq_len_tensor,
            self.lora_indices_tensor,
            self.batches,
            self.max_seq_length,
            self.token_nums,
        )
