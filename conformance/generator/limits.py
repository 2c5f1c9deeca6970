"""Size limits of drawn cases, per profile: what keeps a profile inside its time budget."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Limits:
    max_slots: int  # L
    max_seqs: int
    max_seq_len: int
    max_hidden: int  # H outside the real_hidden / odd_hidden families
    max_width: int  # width of one output slice outside those families
    max_rank: int  # R outside the rank_max and rank_512 families
    large_t: tuple[int, int]  # token range of the large_t family
    max_real_tokens: int  # tokens when a real or odd hidden size is drawn
    max_experts: int = 8  # local experts of the MoE ops outside the many-experts family
    # token range of the long_batch family (rows of the long_sampled family): above 2,048, up to vLLM's
    # default max_num_batched_tokens (8,192)
    long_batch: tuple[int, int] = (2049, 8192)

    def for_moe(self, sized: bool) -> Limits:
        """An MoE case's stacks hold L·E matrices per slice: fewer slots and smaller ranks keep it
        affordable (and fewer still with a real or odd hidden size, up to 14336 features). A long MoE batch
        routes as many tokens as a dense one, two choices each (``LongBatch.token_choices``)."""
        if sized:
            return replace(self, max_slots=min(self.max_slots, 2), max_rank=min(self.max_rank, 16), max_experts=min(self.max_experts, 4))
        return replace(self, max_slots=min(self.max_slots, 4), max_rank=min(self.max_rank, 32))


# Smoke's long batches stay just above 4,096 rows, the cheapest batch past both the 2,048-row limit the family is
# named for and a 4,096-row bucket (a kernel that serves only the first 4,096 rows passes every shorter batch).
SMOKE_LIMITS = Limits(8, 5, 12, 192, 160, 64, (1024, 1280), 4, max_experts=8, long_batch=(4097, 4352))
STANDARD_LIMITS = Limits(8, 6, 24, 384, 320, 128, (1024, 2048), 8, max_experts=16, long_batch=(2049, 8192))
RELEASE_LIMITS = Limits(16, 8, 64, 1024, 1024, 256, (2048, 8192), 16, max_experts=64, long_batch=(2049, 8192))
