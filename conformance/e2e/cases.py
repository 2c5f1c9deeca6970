"""The end-to-end cases as data: which batches, which checks, which dtypes, and which run in smoke.

A batch mixes requests (a prompt and an adapter, or ``None`` for the base model). Every batch fills
its ``max_loras`` slots (adapters take slots in order of first use), so a target that hands base
requests the last slot's adapter has a non-empty last slot to hand them. The checks (``kind``):

* ``teacher_forced_logits``: per-position log-probabilities along the reference's continuation;
* ``greedy_generation``: free-running greedy tokens against the reference's;
* ``batch_invariance``: each request of the batch run alone gives what it gives inside the batch;
* ``order_invariance``: the batch reversed and rotated gives every request what the original order gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from .generation import Request

KINDS = ("teacher_forced_logits", "greedy_generation", "batch_invariance", "order_invariance")
E2E_DTYPES = ("float32", "bfloat16", "float16")
MAX_NEW_TOKENS = 16
TOP_K = 5

# The fixture adapters (conformance/fixtures/adapters/<name>), by what makes each one different.
ATTN = "attn-qv-r8"  # q and v only, rank 8
ALL = "all-linear-r16-rslora"  # every linear module, rank 16, rsLoRA scaling
MLP = "mlp-r6"  # gate/up/down, rank 6 (below the stack's max rank: zero padded)
EMBED = "embed-head-r8"  # embedding, lm_head and o_proj
ADAPTERS = (ATTN, ALL, MLP, EMBED)

PROMPTS = (
    "Once upon a time",
    "The little robot walked",
    "In the garden there was",
    "She opened the door and",
    "Rain fell on the",
    "A",
)

# name → (requests as (prompt index, adapter), max_loras)
BATCHES: dict[str, tuple[tuple[tuple[int, str | None], ...], int]] = {
    # four adapters and two base requests in one batch: the case vLLM's −1 bug breaks
    "mixed": (((0, ATTN), (1, None), (2, ALL), (3, MLP), (4, None), (5, EMBED)), 4),
    # one slot, shared by the adapter requests; base requests around it
    "one-slot": (((0, None), (1, ALL), (2, None), (3, ALL)), 1),
    # no base request
    "adapters-only": (((1, EMBED), (2, MLP), (3, ALL), (4, ATTN)), 4),
    # no adapter request at all (a target may take a no-LoRA shortcut; it must still be the base model)
    "base-only": (((0, None), (3, None), (5, None)), 4),
}


@dataclass(frozen=True)
class E2ECase:
    kind: str
    batch: str
    dtype: str
    smoke: bool

    @property
    def op(self) -> str:
        return self.kind

    @property
    def family(self) -> str:
        """The batch plays the part an op case's edge-case family plays (report, Allure sub-suite)."""
        return self.batch

    @property
    def case_id(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return f"{self.kind}-{self.batch}-{short}"

    @property
    def requests(self) -> list[Request]:
        return [Request(PROMPTS[prompt], adapter) for prompt, adapter in BATCHES[self.batch][0]]

    @property
    def max_loras(self) -> int:
        return BATCHES[self.batch][1]

    def features(self) -> frozenset[str]:
        """The op-level feature names that describe this batch (for expectations and the report)."""
        adapters = [r.adapter for r in self.requests]
        used = {a for a in adapters if a is not None}
        found = {
            "neg1": None in adapters and bool(used),
            "allneg1": not used,
            "one_slot": self.max_loras == 1,
            "last_slot": self.max_loras >= 2 and len(used) == self.max_loras,  # slots fill in order of first use
        }
        return frozenset(name for name, present in found.items() if present)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "batch": self.batch,
            "dtype": self.dtype,
            "max_loras": self.max_loras,
            "requests": [{"prompt": r.prompt, "adapter": r.adapter} for r in self.requests],
            "max_new_tokens": MAX_NEW_TOKENS,
        }


def _all_cases() -> list[E2ECase]:
    """Grouped by dtype, then by slot count, so a process switches engines as rarely as it can."""
    cases = []
    for dtype in E2E_DTYPES:
        for batch in sorted(BATCHES, key=lambda name: -BATCHES[name][1]):
            for kind in ("teacher_forced_logits", "greedy_generation"):
                smoke = batch == "mixed" and dtype in ("float32", "bfloat16")
                cases.append(E2ECase(kind, batch, dtype, smoke))
            if batch == "mixed":
                for kind in ("batch_invariance", "order_invariance"):
                    cases.append(E2ECase(kind, batch, dtype, smoke=kind == "batch_invariance" and dtype == "float32"))
    return cases


E2E_CASES: tuple[E2ECase, ...] = tuple(_all_cases())


def e2e_cases(profile: str) -> list[E2ECase]:
    """The smoke profile runs a subset (the mixed batch); standard and release run every case."""
    return [case for case in E2E_CASES if case.smoke or profile != "smoke"]
