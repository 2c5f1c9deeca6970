"""Size limits of drawn cases, per profile: what keeps a profile inside its time budget."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_slots: int  # L
    max_seqs: int
    max_seq_len: int
    max_hidden: int  # H outside the real_hidden / odd_hidden families
    max_width: int  # width of one output slice outside those families
    max_rank: int  # R outside the rank_max family
    large_t: tuple[int, int]  # token range of the large_t family
    max_real_tokens: int  # tokens when a real or odd hidden size is drawn


SMOKE_LIMITS = Limits(8, 5, 12, 192, 160, 64, (1024, 1280), 4)
STANDARD_LIMITS = Limits(8, 6, 24, 384, 320, 128, (1024, 2048), 8)
RELEASE_LIMITS = Limits(16, 8, 64, 1024, 1024, 256, (2048, 8192), 16)
