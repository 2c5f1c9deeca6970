"""What an op is, as data: the OpInfo of this suite.

An :class:`OpSpec` says which level an op belongs to, which case knobs it reads (``conformance.cases.knobs``:
the generator leaves the others at their defaults), which edge-case families apply, how to fill its
tensors, how to call it, which tensor it writes, how (``output_kind``) and which elements it may
write, which function of the golden reference computes it and, for a wrapper op, which kernel ops
compose it. The generic runner consumes these; nothing here knows a target.

An op is one spec plus its reference module: the op lists (``conformance.ops.ops_at``), the
``reference`` target, ``describe``, ``KernelTarget``'s compositions and the op tables of the docs
(``python -m conformance.targets ops-table``) all derive from the registered specs
(``conformance.ops.register``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from conformance.cases.case import Case
from conformance.cases.knobs import KNOBS

from .level import Level

Tensors = dict[str, torch.Tensor]

# How an op writes its output (OpSpec.output_kind). The verdict judges every kind the same way (the
# written elements against the oracle, all others bit for bit); the kind says what a target must do.
OUTPUT_KINDS = {
    "accumulate": "adds its delta into the output, in the case dtype; an op that reads the add_inputs knob overwrites "
    "the written region with the delta instead when add_inputs=False",
    "buffer": "adds its product into the caller's zeroed float32 shrink buffer ([rows, R], or [S, rows, R] per slice); "
    "never overwrites",
    "replace": "replaces each written row with its result, whatever the row held",
    "index": "fills integer index buffers (moe_lora_align_block_size: sorted pair ids, each block's expert, the padded "
    "counts); any output that meets the op's invariants passes (OpSpec.check)",
}

# What one row of an op's output is (OpSpec.rows).
ROW_KINDS = {
    "tokens": "token (T rows)",
    "sampled": "sampled row (P rows: the logits, the classification heads)",
    "pairs": "(token, choice) pair (T·top_k rows, row t·top_k + k: the fused-MoE ops)",
}

# The ways conformance.targets.kernel_target.KernelTarget composes a wrapper op from kernel ops: vLLM's two
# wrappers, then one per classic kernel family for a backend that has only that family. The order is the
# order KernelTarget tries them in by default (its ``wrapper_paths``) and the order of the docs' columns.
COMPOSITIONS = {
    "lora": "vLLM's PunicaWrapperGPU: lora_shrink / lora_expand over token-sorted metadata; the MoE pairs aligned into blocks",
    "classic": "vLLM's PunicaWrapperCPU: sgmv for a prefill batch, bgmv for a decode batch and the sampled rows; "
    "the MoE pairs by naive block assignment",
    "bgmv": "the bgmv ops alone: one slot per row for every batch, prefill or decode, and for the sampled rows; "
    "the MoE pairs by naive block assignment",
    "sgmv": "the sgmv ops alone: runs of equal slots for every batch, prefill or decode (a decode batch is runs of "
    "one or more rows), and for the sampled rows; the MoE pairs by naive block assignment",
}


@dataclass(frozen=True)
class OpCall:
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class OpSpec:
    name: str
    level: Level
    summary: str
    knobs: frozenset[str]
    make_values: Callable[[Case, torch.Generator], Tensors]
    make_call: Callable[[Case, Tensors, torch.device], OpCall]
    written_mask: Callable[[Case], torch.Tensor]  # bool, shape of the output
    # The golden reference: a kernel op's function (called with the op's arguments), or a wrapper
    # op's method of conformance.reference.PunicaWrapperReference (called on a wrapper that holds
    # the mapping, as ``reference(wrapper, *args)``).
    reference: Callable
    output: str = "out"
    max_slices: int = 1
    rows: str = "tokens"  # what the output's rows are: one of ROW_KINDS
    # An op whose correct outputs are many (moe_lora_align_block_size) is judged by its invariants
    # instead of against the oracle: ``check(case, after, values)`` lists the problems as
    # ``(row, text)`` pairs, empty when the output is correct; it may write the outputs named in
    # ``extra_outputs`` besides ``output``.
    check: Callable[[Case, Tensors, Tensors], list[tuple[int, str]]] | None = None
    extra_outputs: tuple[str, ...] = ()
    # MoE ops: the routing weight is always applied (w2: True), never (w13: False), or drawn (the
    # "routed_weight" knob); None for the other ops.
    routed_weight: bool | None = None
    output_kind: str = "accumulate"  # one of OUTPUT_KINDS
    # A wrapper op KernelTarget derives from kernel ops: per composition (COMPOSITIONS), the kernel ops it
    # calls. A wrapper op built from other wrapper ops instead (add_lora_linear) names them in
    # ``composed_of``. Both name registered ops, checked when the op is registered (conformance.ops).
    compositions: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    composed_of: tuple[str, ...] = ()
    # The edge-case families aimed at the op (conformance.generator.families), by name; None: every family
    # whose knobs it reads. An op that is one production call shape (token_classification_head) names the
    # few corners that call can reach, and the families made for it apply to it alone.
    families: tuple[str, ...] | None = None
    # The op rounds its delta to the case dtype before adding it to a wider output (a float32 one): judged by the
    # case dtype's tolerances, not the output's (conformance.verdict.judge's rounding_dtype).
    delta_in_case_dtype: bool = False

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every tensor the op writes; all others are read-only."""
        return (self.output, *self.extra_outputs)

    def row_slots(self, case: Case) -> tuple[int, ...]:
        """The adapter slot of each row of the output."""
        return {"tokens": case.token_slots, "sampled": case.sampled_slots, "pairs": case.pair_slots}[self.rows]

    def __post_init__(self) -> None:
        unknown = self.knobs - KNOBS.keys()
        if unknown:
            raise ValueError(f"op {self.name}: unknown knobs {sorted(unknown)}; the knobs are conformance.cases.knobs.KNOBS")
        if self.level not in (Level.KERNEL, Level.WRAPPER):
            raise ValueError(f"op {self.name}: an op case is at level kernel or wrapper, not {self.level}")
        if self.rows not in ROW_KINDS:
            raise ValueError(f"op {self.name}: rows must be one of {', '.join(ROW_KINDS)}, not {self.rows!r}")
        if not callable(self.reference):
            raise ValueError(f"op {self.name}: its reference must be a function of conformance.reference")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"op {self.name}: output_kind must be one of {', '.join(OUTPUT_KINDS)}, not {self.output_kind!r}")
        if self.output_kind == "index" and self.check is None:
            raise ValueError(f"op {self.name}: an index output has many correct values: judge it by its invariants (check)")
        self._check_composition()

    def _check_composition(self) -> None:
        """Its shape only; that the named ops are registered kernel / wrapper ops is checked on registration."""
        if (self.compositions or self.composed_of) and self.level != Level.WRAPPER:
            raise ValueError(f"op {self.name}: only a wrapper op is composed of other ops")
        if self.compositions and self.composed_of:
            raise ValueError(f"op {self.name}: composed of kernel ops (compositions) or of wrapper ops (composed_of), not both")
        unknown = set(self.compositions) - COMPOSITIONS.keys()
        if unknown:
            raise ValueError(f"op {self.name}: unknown compositions {sorted(unknown)}; they are {', '.join(COMPOSITIONS)}")
        empty = [path for path, kernels in self.compositions.items() if not kernels]
        if empty:
            raise ValueError(f"op {self.name}: its {' and '.join(empty)} composition names no kernel op")


def row_mask(slots: tuple[int, ...]) -> torch.Tensor:
    """True for rows that use an adapter."""
    return torch.tensor([s != -1 for s in slots], dtype=torch.bool)


def rows_and_columns(slots: tuple[int, ...], width: int, first: int, last: int) -> torch.Tensor:
    """``[rows, width]`` mask: adapter rows × columns ``[first, last)``."""
    columns = torch.zeros(width, dtype=torch.bool)
    columns[first:last] = True
    return row_mask(slots)[:, None] & columns[None, :]
