"""``python -m conformance.targets describe NAME``: which ops a target supports, per dtype, and why not.

For every op (the kernel ops, then the wrapper ops) and every dtype the suite draws, one status:

* ``implemented``: the target defines the op;
* ``derived from kernels (…) by the X composition``: a :class:`KernelTarget` composes the wrapper
  method from those of its kernel ops, by the first composition of its ``wrapper_paths`` whose kernels
  it defines (``add_lora_linear`` through ``add_shrink`` and ``add_expand``, each part naming its own
  composition; ``OpStatus.composition`` holds it, and the header lists the order tried);
* ``not supported: …``: why the suite will report the op's cases "not supported": the op is not
  defined, the kernels a wrapper method would be derived from are missing (named, per composition,
  so the list says what to implement next), the dtype is not in ``target.dtypes``, the target's own
  ``unsupported_reason`` refuses a small probe case, or the target cannot run here.

Restrictions a target declares per case rather than per op show up as a note after the status when
a probe case that turns one knob the op reads (``FEATURE_PROBES``) is refused where the plain probe is
not. Every knob of ``conformance.cases.knobs.KNOBS`` has a probe (a test checks it), so a refusal that
depends on one knob shows here; refusals that depend on combinations show only in a run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from conformance.cases.case import DTYPES, Case
from conformance.ops import OP_SPECS, Level, OpSpec, ops_at

from .base import Target, TargetUnavailable
from .kernel_target import KernelTarget
from .registry import known_targets, resolve

# Case features probed one at a time: (what, the knob it turns, the fields changed). The probe applies
# to the ops that read the knob (None: to every op).
FEATURE_PROBES = (
    ("LoRA bias", "bias", {"bias": True}),
    ("a decode batch", "prefill", {"is_prefill": False}),
    ("several slices", "slices", {"output_slices": (16, 16, 16), "output_width": 48}),
    ("seven packed slices", "slices", {"output_slices": (8, 9, 10, 11, 12, 13, 14), "output_width": 77}),
    ("a float32 expand input", "expand_input", {"expand_input_dtype": "float32"}),
    ("an output offset", "offset", {"offset_start": 8, "output_width": 24}),
    ("columns beyond the written slice", "wide", {"output_width": 24}),
    ("add_inputs=False", "add_inputs", {"add_inputs": False}),
    ("a scale other than 1", "scale", {"scale": 0.5}),
    ("an odd hidden size", "hidden", {"hidden_size": 17}),
    ("an odd output width", "widths", {"output_slices": (17,), "output_width": 17}),
    ("4-D weight stacks", "w4d", {"weights_4d": True}),
    # the fused-MoE ops
    ("experts on another rank (expert_map)", "routing", {"expert_map": (0, 1, -1)}),
    ("shared-expert stacks", "routing", {"shared_experts": True}),
    ("a disabled adapter", "routing", {"disabled_slots": (0,)}),
    ("gate and up as two slices", "gate_up", {"output_slices": (8, 8)}),
    ("mul_routed_weight", "routed_weight", {"routed_weight": True}),
    ("block size 64", "blocks", {"block_size": 64}),
    ("naive block assignment", "naive", {"naive_blocks": True}),
    # apply_lora_full_linear
    ("a disabled full-linear module", "module_enabled", {"disabled_slots": (0,)}),
    # the sgmv ops: segments listed out of row order, rows 1–2 between them uncovered
    ("segments out of row order, with uncovered rows", "segments", {"seq_starts": (3, 0), "num_rows": 5}),
    # the fp8 ops (their plain probe has per-tensor scales)
    ("per-token and per-channel fp8 scales", "fp8_scales", {"fp8_scales": "channel"}),
    ("block-wise fp8 scales", "fp8_scales", {"fp8_scales": "block", "group_k": 8, "group_n": 8}),
    # vLLM 0.34: speculative-decoding logits rows, a partially packed adapter, a folded embed_scale
    ("1 + draft tokens logits rows per request", "spec_decode", {"logits_per_seq": (3, 1)}),
    ("an adapter lacking a packed sub-module", "packed", {"absent_slices": ((0, 0),)}),
    ("embed_scale folded into LoRA-B", "embed_scale", {"embed_scale": 8.0}),
)


@dataclass(frozen=True)
class OpStatus:
    op: str
    level: str  # "kernel" or "wrapper"
    dtype: str
    supported: bool
    status: str  # "implemented", "derived from kernels (…) by …" or "not supported: …", maybe with notes
    # The composition a derived wrapper op uses (KernelTarget.wrapper_path; for an op made of wrapper ops,
    # those its derived parts use, in order, joined by ", "); None where the op is not derived from kernels.
    composition: str | None = None


@dataclass(frozen=True)
class TargetDescription:
    name: str
    reference: str
    description: str
    usable: bool
    reason: str  # why it cannot run here ("" when usable)
    dtypes: tuple[str, ...]
    wrapper_paths: tuple[str, ...] | None  # the compositions tried, for a KernelTarget
    statuses: tuple[OpStatus, ...]

    def status(self, op: str, dtype: str) -> OpStatus:
        return next(s for s in self.statuses if s.op == op and s.dtype == dtype)


def probe_case(op: str, dtype: str, **changes) -> Case:
    """A small case of ``op``: two tokens of slot 0 and one without adapter, rank 8, 16 features (and for
    an MoE op two experts, two choices per token, block size 16; for an fp8 op per-tensor scales)."""
    case = Case(
        op=op, dtype=dtype, seq_lens=(2, 1), seq_slots=(0, -1), num_slots=2, max_rank=8, adapter_ranks=(8, 8),
        hidden_size=16, output_slices=(16,), output_width=16,
    )
    spec = OP_SPECS[op]
    if "routing" in spec.knobs:
        routing = {"num_experts": 2, "top_k": 2, "topk_ids": ((0, 1), (1, 0), (0, 1)), "routed_weight": bool(spec.routed_weight)}
        case = dataclasses.replace(case, **routing, block_size=16 if "blocks" in spec.knobs else 0)
    if "fp8_scales" in spec.knobs:
        case = dataclasses.replace(case, fp8_scales="tensor")
    return dataclasses.replace(case, **changes)


def describe(name: str) -> TargetDescription:
    """Every op × dtype status of the named target (a registered name or ``package.module:Class``): under the
    class's own short ``name``, with the ``module:Class`` reference that loads it beside."""
    return describe_class(resolve(name), reference=known_targets().get(name, name))


def describe_class(cls: type[Target], name: str | None = None, reference: str | None = None) -> TargetDescription:
    """Every op × dtype status of a target class; constructs it unless it cannot run here."""
    name = name or cls.name
    try:
        target = cls()
    except TargetUnavailable as exc:
        target, reason = cls.__new__(cls), str(exc)  # not constructed: only what its class defines
    else:
        reason = ""
    statuses = tuple(
        dataclasses.replace(_status(target, op, dtype, reason), composition=_composition(target, op))
        for op in ops_at(Level.KERNEL) + ops_at(Level.WRAPPER)
        for dtype in DTYPES
    )
    return TargetDescription(
        name=name,
        reference=reference or f"{cls.__module__}:{cls.__qualname__}",
        description=cls.description,
        usable=not reason,
        reason=reason,
        dtypes=tuple(d for d, torch_dtype in DTYPES.items() if torch_dtype in cls.dtypes),
        wrapper_paths=tuple(cls.wrapper_paths) if issubclass(cls, KernelTarget) else None,
        statuses=statuses,
    )


def _status(target: Target, op: str, dtype: str, unavailable: str) -> OpStatus:
    level = OP_SPECS[op].level.value
    definition, defined = _definition(target, op)
    if unavailable:
        return OpStatus(op, level, dtype, False, f"not supported: {target.name} cannot run here (see above); as defined: {definition}")
    if not defined:
        return OpStatus(op, level, dtype, False, f"not supported: {definition}")
    if DTYPES[dtype] not in target.dtypes:
        claimed = ", ".join(d for d, t in DTYPES.items() if t in target.dtypes)
        return OpStatus(op, level, dtype, False, f"not supported: {dtype} is not in {target.name}'s dtypes ({claimed})")
    spec = OP_SPECS[op]
    refused = _refusal(target, probe_case(op, dtype))
    if refused:
        return OpStatus(op, level, dtype, False, f"not supported: {refused}")
    notes = _feature_notes(target, spec, op, dtype)
    return OpStatus(op, level, dtype, True, definition + "".join(f"; {note}" for note in notes))


def _definition(target: Target, op: str) -> tuple[str, bool]:
    """What the target's class makes of ``op`` and whether that is an implementation."""
    if op in target.implemented_ops():
        if isinstance(target, KernelTarget) and OP_SPECS[op].level == Level.WRAPPER and not target.overrides(op):
            return _derivation(target, op), True
        return "implemented", True
    if isinstance(target, KernelTarget) and OP_SPECS[op].level == Level.WRAPPER:
        return _why_not_derived(target, op), False
    return target.why_not_implemented.get(op, f"{target.name} does not define {op}"), False


def _composition(target: Target, op: str) -> str | None:
    """The composition(s) a KernelTarget derives wrapper op ``op`` by; None when it does not derive it."""
    if not isinstance(target, KernelTarget) or OP_SPECS[op].level != Level.WRAPPER or not target.derived_from(op):
        return None
    return _compositions(target, op)


def _compositions(target: KernelTarget, op: str) -> str:
    """``_paths`` as said: each composition once, in call order."""
    return ", ".join(dict.fromkeys(_paths(target, op)))


def _paths(target: KernelTarget, op: str) -> list[str]:
    """The kernel compositions a derived wrapper op runs, through its parts (a layer op composed of
    ``add_lora_linear``, itself of ``add_shrink`` and ``add_expand``) down to the kernel-backed ones."""
    parts = OP_SPECS[op].composed_of
    if not parts:
        return [target.wrapper_path(op)]
    return [path for part in parts if not target.overrides(part) for path in _paths(target, part)]


def _derivation(target: KernelTarget, op: str) -> str:
    kernels = ", ".join(target.derived_from(op))
    parts = OP_SPECS[op].composed_of
    if not parts:
        return f"derived from kernels ({kernels}) by the {target.wrapper_path(op)} composition"
    own = [part for part in parts if target.overrides(part)]
    sources = ([f"kernels ({kernels})"] if kernels else []) + ([f"{', '.join(own)} (implemented)"] if own else [])
    steps = [part if part in own else f"{part} ({_compositions(target, part)} composition)" for part in parts]
    return f"derived from {' and '.join(sources)} via {' then '.join(steps)}"


def _why_not_derived(target: KernelTarget, op: str) -> str:
    if not callable(getattr(target, op, None)):
        return f"{target.name} sets {op} to None (opted out)"
    spec = OP_SPECS[op]
    if spec.composed_of:
        missing = [part for part in spec.composed_of if not target.wrapper_implemented(part)]
        return "; ".join(f"needs {part}, which is {_why_not_derived(target, part).removeprefix('not supported: ')}" for part in missing)
    paths = [path for path in target.wrapper_paths if path in spec.compositions]
    if not paths:
        return f"{target.name} does not define {op}, and no composition of kernel ops gives it"
    present = set(target.kernel_ops())
    # compositions that lack the same kernels are named together (the MoE ops need fused_moe_lora in all but one)
    lacking: dict[tuple[str, ...], list[str]] = {}
    for path in paths:
        lacking.setdefault(tuple(kernel for kernel in spec.compositions[path] if kernel not in present), []).append(path)
    options = [f"{' and '.join(missing)} ({_either(same)} composition)" for missing, same in lacking.items()]
    return "missing kernels " + " or ".join(options)


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _refusal(target: Target, case: Case) -> str | None:
    try:
        return target.unsupported_reason(case)
    except Exception as exc:  # noqa: BLE001 - a crash of the target's own check is worth saying
        return f"unsupported_reason raised {type(exc).__name__}: {exc}"


def _feature_notes(target: Target, spec: OpSpec, op: str, dtype: str) -> list[str]:
    notes = []
    for what, knob, changes in FEATURE_PROBES:
        if knob is None or knob in spec.knobs:
            refused = _refusal(target, probe_case(op, dtype, **changes))
            if refused:
                notes.append(f"cases with {what} not supported: {refused}")
    return notes


def render(description: TargetDescription) -> str:
    """The text ``describe`` prints: a header, one line per op × dtype, and a count."""
    d = description
    lines = [f"{d.name}  ({d.reference})"]
    if d.description:
        lines.append(d.description)
    # An unusable target says so first and last: between them are 66 lines of what its class defines, which
    # read as if it ran here (a CUDA target described on a machine without a GPU did).
    lines.append("can run here: yes" if d.usable else f"can run here: NO, {d.name} is unusable on this machine: {d.reason}")
    lines.append(f"dtypes: {', '.join(d.dtypes)}")
    if d.wrapper_paths is not None:
        lines.append(
            "wrapper methods: derived from the kernel ops by KernelTarget unless defined, each by the first "
            f"composition whose kernels are all defined, tried in this order (wrapper_paths): {', '.join(d.wrapper_paths)}"
        )
    lines.append("")
    op_width = max(len(op) for op in OP_SPECS)
    dtype_width = max(len(dtype) for dtype in DTYPES)
    lines.append(f"{'op':{op_width}}  {'level':7}  {'dtype':{dtype_width}}  status")
    for s in d.statuses:
        lines.append(f"{s.op:{op_width}}  {s.level:7}  {s.dtype:{dtype_width}}  {s.status}")
    supported = sum(s.supported for s in d.statuses)
    lines.append("")
    lines.append(f"supported: {supported} of {len(d.statuses)} op × dtype pairs")
    if not d.usable:
        lines.append(f"{d.name} is unusable on this machine (why: the 'can run here' line at the top); the statuses above "
                     "say only what its class defines, not what can run here")
    return "\n".join(lines)
