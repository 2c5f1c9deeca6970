"""The end-to-end cases as data: which batches, which checks, which dtypes, and which run in smoke.

A batch mixes requests (a prompt and an adapter, or ``None`` for the base model) on one fixture model:
the dense Llama (batch ``patterns-mixed`` with adapters whose modules differ in rank and alpha, feature
``per_module_rank``), the Mixtral whose adapters put LoRA on its experts (batches ``moe-*``, reported
as the ops ``moe_<kind>``; ``moe-fp8-mixed`` on its twin whose experts are stored in fp8), or the Cohere whose parallel block the decoder runs as one ``add_lora_linear``
call of 5 packed slices (batch ``packed5-mixed``, feature ``packed_5_slices``). Every batch fills its
``max_loras`` slots (adapters take slots in order of first use), so a target that hands base requests
the last slot's adapter has a non-empty last slot to hand them. The checks (``kind``):

* ``teacher_forced_logits``: per-position log-probabilities along the reference's continuation;
* ``greedy_generation``: free-running greedy tokens against the reference's;
* ``batch_invariance``: each request of the batch run alone gives what it gives inside the batch;
* ``order_invariance``: the batch reversed and rotated gives every request what the original order gives;
* ``token_classification`` (the token classifier, batch ``tokcls-mixed``): every prompt token's label
  log-probabilities, scored like teacher-forced logits on the reference's labels (no generation).
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.query import case_id
from conformance.wire import record_from_json, record_to_json

from .generation import Request

KINDS = ("teacher_forced_logits", "greedy_generation", "batch_invariance", "order_invariance")
TOKEN_CLASSIFICATION = "token_classification"  # the token classifier's one check
E2E_DTYPES = ("float32", "bfloat16", "float16")
# The fp8 MoE model runs no float16 case: an activation that float16's error moves across an e4m3 rounding
# boundary changes a correct target's log-probabilities beyond float16's bound (measured 0.21 > 0.1 on request
# moe-experts-r4, plain-torch and the reference alike, teacher-forced moe-fp8-mixed); the suite has no near-tie rule for
# fp8 rounding (docs/e2e.md).
FP8_DTYPES = ("float32", "bfloat16")
MAX_NEW_TOKENS = 16
TOP_K = 5

# The fixture models (fixtures/<model>, shipped as conformance/fixtures/<model>) and the directory of each one's adapters.
DENSE_MODEL = "tiny-llama"
MOE_MODEL = "tiny-mixtral"  # 6 experts, top-2
FP8_MOE_MODEL = "tiny-mixtral-fp8"  # the same, its experts stored in fp8 e4m3 with per-tensor scales
PARALLEL_MODEL = "tiny-cohere"  # a parallel block: q/k/v/gate/up as one call of 5 slices
TOKCLS_MODEL = "tiny-llama-tokcls"  # a Llama token classifier: per-token label logits, no generation
MODEL_ADAPTERS = {DENSE_MODEL: "adapters", MOE_MODEL: "moe-adapters", FP8_MOE_MODEL: "moe-adapters",
                  PARALLEL_MODEL: "cohere-adapters", TOKCLS_MODEL: "tokcls-adapters"}

# The fixture adapters (fixtures/adapters/<name>), by what makes each one different.
ATTN = "attn-qv-r8"  # q and v only, rank 8
ALL = "all-linear-r16-rslora"  # every linear module, rank 16, rsLoRA scaling
MLP = "mlp-r6"  # gate/up/down, rank 6 (below the stack's max rank: zero padded)
EMBED = "embed-head-r8"  # embedding, lm_head and o_proj
ADAPTERS = (ATTN, ALL, MLP, EMBED)
# Adapters whose modules differ in rank and alpha (PEFT rank_pattern / alpha_pattern; feature per_module_rank)
PATTERNS = "patterns-r8"  # q, k, v, o, up, down; ranks 4/2 (q, by layer), 12 (down), 8; alphas per module
PATTERNS_RSLORA = "patterns-r6-rslora"  # embedding, q, v, gate, lm_head; ranks 4, 6, 10, 2; rsLoRA
PATTERN_ADAPTERS = (PATTERNS, PATTERNS_RSLORA)

# The MoE model's adapters (fixtures/moe-adapters/<name>): PEFT target_parameters on the experts.
EXPERTS = "moe-experts-r4"  # the experts only (gate_up_proj and down_proj), rank 4
EXPERTS_ATTN = "moe-experts-attn-r8-rslora"  # the experts and q/k/v/o, rank 8, rsLoRA scaling
MOE_ATTN = "moe-attn-qv-r6"  # q and v only: its slot has MoE LoRA disabled (adapter_enabled 0)
MOE_ADAPTERS = (EXPERTS, EXPERTS_ATTN, MOE_ATTN)

# The parallel-block model's adapters (fixtures/cohere-adapters/<name>), by the slices of the
# packed q/k/v/gate/up call that carry LoRA (the others are zero in that adapter's slot).
FIVE = "cohere-qkv-gate-up-r8"  # all five slices, rank 8
K_UP = "cohere-k-up-r4"  # slices 1 and 4 (k, up), rank 4
GATE_UP = "cohere-gate-up-o-down-r6-rslora"  # slices 3 and 4 (gate, up, past QKV's three), o and down, rsLoRA
PARALLEL_ADAPTERS = (FIVE, K_UP, GATE_UP)

# The token classifier's adapters (fixtures/tokcls-adapters/<name>): two save a head of their own
# (modules_to_save), one does not (its tokens get the base head).
QV_HEAD = "tokcls-qv-head-r4"
O_DOWN_HEAD = "tokcls-o-down-head-r8-rslora"
QKV_NO_HEAD = "tokcls-qkv-r6-nohead"
TOKCLS_ADAPTERS = (QV_HEAD, O_DOWN_HEAD, QKV_NO_HEAD)
SAVED_HEAD_ADAPTERS = (QV_HEAD, O_DOWN_HEAD)

PROMPTS = (
    "Once upon a time",
    "The little robot walked",
    "In the garden there was",
    "She opened the door and",
    "Rain fell on the",
    "A",
)

@dataclass(frozen=True)
class Batch:
    requests: tuple[tuple[int, str | None], ...]  # (prompt index, adapter)
    max_loras: int
    model: str = DENSE_MODEL


BATCHES: dict[str, Batch] = {
    # four adapters and two base requests in one batch: the case vLLM's −1 bug breaks
    "mixed": Batch(((0, ATTN), (1, None), (2, ALL), (3, MLP), (4, None), (5, EMBED)), 4),
    # one slot, shared by the adapter requests; base requests around it
    "one-slot": Batch(((0, None), (1, ALL), (2, None), (3, ALL)), 1),
    # no base request
    "adapters-only": Batch(((1, EMBED), (2, MLP), (3, ALL), (4, ATTN)), 4),
    # no adapter request at all (a target may take a no-LoRA shortcut; it must still be the base model)
    "base-only": Batch(((0, None), (3, None), (5, None)), 4),
    # per-module ranks and alphas beside a plain adapter, with base requests; the rsLoRA one in the last slot
    "patterns-mixed": Batch(((0, PATTERNS), (1, None), (2, ATTN), (3, PATTERNS_RSLORA), (4, None), (5, PATTERNS)), 3),
    # the MoE model: slot 0's adapter has no expert LoRA (adapter_enabled 0), the last slot's has;
    # two base requests, each expert adapter used twice
    "moe-mixed": Batch(((0, MOE_ATTN), (1, None), (2, EXPERTS), (3, EXPERTS_ATTN), (4, None), (5, EXPERTS)), 3, MOE_MODEL),
    # one slot, expert and attention LoRA, base requests around it
    "moe-one-slot": Batch(((0, None), (1, EXPERTS_ATTN), (2, None), (3, EXPERTS_ATTN)), 1, MOE_MODEL),
    # the fp8 MoE model: quantized activations in the base experts beside the LoRA that reads them unquantized;
    # both of its adapters (the attention one in the last slot) and two base requests
    "moe-fp8-mixed": Batch(((0, EXPERTS), (1, None), (2, EXPERTS_ATTN), (3, None), (4, EXPERTS)), 2, FP8_MOE_MODEL),
    # the token classifier: tokens with a saved head (two adapters, one of them in the last slot), tokens of an
    # adapter without one (the base head, its LoRA applied) and base tokens, in one prefill
    "tokcls-mixed": Batch(((0, O_DOWN_HEAD), (1, None), (2, QKV_NO_HEAD), (3, QV_HEAD), (4, None), (5, O_DOWN_HEAD)), 3,
                          TOKCLS_MODEL),
    # the parallel-block model: every adapter (each with LoRA on slice 3 or 4) and two base requests, the
    # five-slice adapter used twice
    "packed5-mixed": Batch(((0, K_UP), (1, None), (2, FIVE), (3, GATE_UP), (4, None), (5, FIVE)), 3, PARALLEL_MODEL),
}
# The batches that also run the invariance checks (each model's mixed batch).
INVARIANCE_BATCHES = ("mixed", "moe-mixed", "packed5-mixed")


@dataclass(frozen=True)
class E2ECase:
    kind: str
    batch: str
    dtype: str
    smoke: bool

    def __post_init__(self) -> None:
        if self.kind not in (*KINDS, TOKEN_CLASSIFICATION) or self.batch not in BATCHES or self.dtype not in E2E_DTYPES:
            raise ValueError(f"no end-to-end case has kind {self.kind!r}, batch {self.batch!r} and dtype {self.dtype!r}")
        if self.model == FP8_MOE_MODEL and self.dtype not in FP8_DTYPES:
            raise ValueError(f"no end-to-end case runs the fp8 model {FP8_MOE_MODEL!r} in {self.dtype} (only {', '.join(FP8_DTYPES)}: "
                             "cases.FP8_DTYPES says why)")

    @property
    def model(self) -> str:
        return BATCHES[self.batch].model

    @property
    def is_moe(self) -> bool:
        return self.model in (MOE_MODEL, FP8_MOE_MODEL)

    @property
    def is_token_classifier(self) -> bool:
        return self.model == TOKCLS_MODEL

    @property
    def op(self) -> str:
        """The report's op: the check, told apart for the MoE model (its own rows, its own expectations)."""
        return f"moe_{self.kind}" if self.is_moe else self.kind

    @property
    def family(self) -> str:
        """The batch plays the part an op case's edge-case family plays (report, Allure sub-suite)."""
        return self.batch

    @property
    def case_id(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return case_id("model", self.kind, {"batch": self.batch, "dtype": short})

    @property
    def requests(self) -> list[Request]:
        return [Request(PROMPTS[prompt], adapter) for prompt, adapter in BATCHES[self.batch].requests]

    @property
    def max_loras(self) -> int:
        return BATCHES[self.batch].max_loras

    def features(self) -> frozenset[str]:
        """The op-level feature names that describe this batch (for expectations and the report)."""
        adapters = [r.adapter for r in self.requests]
        used = {a for a in adapters if a is not None}
        found = {
            "neg1": None in adapters and bool(used),
            "allneg1": not used,
            "one_slot": self.max_loras == 1,
            "last_slot": self.max_loras >= 2 and len(used) == self.max_loras,  # slots fill in order of first use
            "packed_5_slices": self.model == PARALLEL_MODEL,
            "per_module_rank": bool(used & set(PATTERN_ADAPTERS)),
            # tokens of a saved head, of an adapter without one and without adapter in one call (11 labels)
            "token_classification": self.is_token_classifier and bool(used & set(SAVED_HEAD_ADAPTERS))
            and bool(used - set(SAVED_HEAD_ADAPTERS)) and None in adapters,
            # a slot whose adapter saved no head (its head is disabled)
            "module_disabled": self.is_token_classifier and bool(used - set(SAVED_HEAD_ADAPTERS)),
        }
        return frozenset(name for name, present in found.items() if present)

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS

    # written beside the fields for readers of results.json; from_json checks that they agree
    DERIVED_JSON = ("model", "is_moe", "max_loras", "requests", "max_new_tokens")

    def to_json(self) -> dict:
        return record_to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> E2ECase:
        """The case ``to_json`` wrote; ``ValueError`` naming a missing, unknown, mistyped or contradicted field."""
        return record_from_json(cls, data, "end-to-end case")


# (kind, batch, dtype) of the smoke profile: teacher-forced and greedy on the mixed batches, in float32 and
# (dense) bfloat16, and the dense batch invariance in float32; the invariance checks on every model's mixed
# batch in standard
SMOKE = frozenset(
    {(kind, "mixed", dtype) for kind in KINDS[:2] for dtype in ("float32", "bfloat16")}
    | {("batch_invariance", "mixed", "float32")}
    | {(kind, batch, "float32") for kind in KINDS[:2] for batch in ("moe-mixed", "packed5-mixed")}
    | {("greedy_generation", "moe-fp8-mixed", "float32")}
)


def _all_cases() -> list[E2ECase]:
    """Grouped by model and dtype, then by slot count, so a process switches engines as rarely as it can."""
    cases = []
    for model in MODEL_ADAPTERS:
        for dtype in E2E_DTYPES if model != FP8_MOE_MODEL else FP8_DTYPES:
            batches = [name for name in BATCHES if BATCHES[name].model == model]
            for batch in sorted(batches, key=lambda name: -BATCHES[name].max_loras):
                kinds = (TOKEN_CLASSIFICATION,) if model == TOKCLS_MODEL else KINDS if batch in INVARIANCE_BATCHES else KINDS[:2]
                for kind in kinds:
                    cases.append(E2ECase(kind, batch, dtype, (kind, batch, dtype) in SMOKE))
    return cases


E2E_CASES: tuple[E2ECase, ...] = tuple(_all_cases())


def e2e_cases(profile: str) -> list[E2ECase]:
    """The smoke profile runs a subset (the mixed batch); standard and release run every case."""
    return [case for case in E2E_CASES if case.smoke or profile != "smoke"]
