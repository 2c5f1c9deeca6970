"""The MoE LoRA benchmark: ``add_lora_w13`` / ``add_lora_w2`` at Mixtral, Qwen3-MoE, DeepSeek-V3 and gpt-oss shapes → docs/benchmarks-moe.md.

Plan: every (model, op, T, implementation). As in :mod:`benchmarks.ops`, a combination the model below
predicts would not fit the memory cap or would run past the time cap is skipped and listed with the
reason; nothing is dropped silently. Each kept combination runs in a fresh process forked from a
server that imported torch, the reference and the HPU targets once (``moe_preload``), measured by
:func:`benchmarks.measure.measure` (median warm time, peak extra RSS of the first call).

The cost model (one thread, this machine class; calibrated on the first runs, a rule for skipping,
not a result). With ``P`` the pairs ``T·top_k`` (``P_pad`` padded to the HPU bucket, ``P_served`` those
of tokens with an adapter), ``K``/``N`` the input/output width of a slice, ``S`` slices:

* the grouped reference and the gathers do the LoRA FLOPs, ``2·P_served·R·(K + N)·S``;
* the mask variant runs two dense GEMMs over all ``L·E·R`` virtual-slot columns for every padded pair,
  ``2·P_pad·L·E·R·(K + N)·S`` FLOPs (``L·E·P_pad/P_served`` times the grouped count), plus the
  ``[P_pad, L·E·R]`` intermediates and the ``[P_pad, N]`` write-back;
* the gathers copy ``R·(K + N)`` weight elements per pair and slice (``P_pad`` pairs for the HPU
  variant, ``P_served`` for the plain one);
* the grouped variant multiplies the ``B·b`` positions of its static block layout
  (``grouped_moe.block_shape``: ``B`` blocks of ``b`` pairs, at most 1.5 ``P_pad``), ``2·B·b·R·(K + N)·S``
  FLOPs, and gathers ``R·(K + N)`` weight elements per block and slice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .isolated import measure_each
from .markdown import seconds, size, table
from .moe_workload import ADAPTERS, IMPLEMENTATIONS, RANK, MoEWorkload

# (model, H, I, E, top_k)
SHAPES = [
    ("Mixtral-8x7B", 4096, 14336, 8, 2),
    ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    ("DeepSeek-V3", 7168, 2048, 256, 8),  # the routed experts (the shared expert is a dense layer)
    ("gpt-oss-120b", 2880, 2880, 128, 4),
]
TOKENS = (1, 64, 2048, 8192)
OPS = ("w13", "w2")


@dataclass(frozen=True)
class Plan:
    shapes: list
    tokens: tuple[int, ...]
    ops: tuple[str, ...]
    implementations: tuple[str, ...]
    adapters: int = ADAPTERS
    rank: int = RANK
    memory_cap: int = 11 * 2**30  # inputs + predicted extra, per measurement (24 GiB, shared machine)
    seconds_cap: float = 120.0  # predicted seconds of one call


FULL = Plan(SHAPES, TOKENS, OPS, tuple(IMPLEMENTATIONS))
QUICK = replace(FULL, tokens=(1, 64))
SMOKE_TEST = replace(FULL, shapes=[("tiny 8-expert top-2", 64, 48, 8, 2), ("tiny 16-expert top-4", 32, 16, 16, 4)],
                     tokens=(1, 32))


# -- sizes -------------------------------------------------------------------------------------


def padded_pairs(w: MoEWorkload) -> int:
    """The HPU variants' pair count: the token bucket (the targets' policy) times top_k."""
    from conformance.targets.hpu.buckets import BucketPolicy
    from conformance.targets.hpu.targets import ENV_BUCKETS

    return BucketPolicy.from_spec(os.environ.get(ENV_BUCKETS)).bucket(w.tokens) * w.top_k


def tokens_with_adapter(tokens: int, adapters: int) -> int:
    """How many of :func:`~benchmarks.workload.slot_per_row`'s slots are not −1, in closed form (the skip
    model asks for T up to 2²⁰): sequence ``i`` holds the tokens ``t`` with ``⌊t·S/T⌋ = i`` and has no
    adapter when ``i`` is a multiple of ``L + 1``."""
    if tokens <= 1:
        return tokens
    sequences = min(16, tokens)
    without = sum(-(-(i + 1) * tokens // sequences) + (i * tokens // -sequences)
                  for i in range(0, sequences, adapters + 1))
    return tokens - without


def served_pairs(w: MoEWorkload) -> int:
    """Pairs of tokens with an adapter (every adapter is enabled, every expert local)."""
    return tokens_with_adapter(w.tokens, w.adapters) * w.top_k


def virtual_columns(w: MoEWorkload) -> int:
    """L·E·R: the columns of the mask variant's GEMMs (each (slot, expert) a virtual slot)."""
    return w.adapters * w.experts * w.rank


def stack_elements(w: MoEWorkload) -> int:
    """A and B of every slice: L·E·R·(K + N)·S."""
    return virtual_columns(w) * (w.in_width + w.out_width) * w.slices


def input_bytes(w: MoEWorkload) -> int:
    rows = w.tokens if w.op == "w13" else w.pairs
    elements = stack_elements(w) + rows * w.in_width + w.pairs * w.out_width * w.slices
    return elements * w.dtype.itemsize


def grouped_flops(w: MoEWorkload) -> int:
    """The LoRA FLOPs of the served pairs: what the grouped reference and the gathers compute."""
    return 2 * served_pairs(w) * w.rank * (w.in_width + w.out_width) * w.slices


def mask_flops(w: MoEWorkload) -> int:
    """The mask variant's two dense GEMMs over all L·E·R columns, for every padded pair."""
    return 2 * padded_pairs(w) * virtual_columns(w) * (w.in_width + w.out_width) * w.slices


def gathered_elements(w: MoEWorkload) -> int:
    pairs = served_pairs(w) if w.implementation == "plain-gather" else padded_pairs(w)
    return pairs * w.rank * (w.in_width + w.out_width) * w.slices


def block_layout(w: MoEWorkload):
    """The grouped variant's static blocks for this bucket (``grouped_moe.block_shape``)."""
    from conformance.targets.hpu.grouped_moe import block_shape

    return block_shape(padded_pairs(w), w.adapters * w.experts)


def grouped_static_flops(w: MoEWorkload) -> int:
    """What the grouped variant's two ``bmm`` compute: every position of its static layout, used or not."""
    return 2 * block_layout(w).positions * w.rank * (w.in_width + w.out_width) * w.slices


def grouped_gathered_elements(w: MoEWorkload) -> int:
    """The weight elements the grouped variant gathers: one A and one B per block and slice."""
    return block_layout(w).blocks * w.rank * (w.in_width + w.out_width) * w.slices


# Seconds per unit on this machine class at one thread, calibrated on the first runs (first calls,
# which fault in fresh pages; warm calls are up to 2× faster): float32 GEMM ~40 GFLOP/s; the mask
# variant's elementwise passes per [P, L·E·R] and per [P, N] element; per gathered weight element.
_GEMM_S_PER_FLOP = 25e-12
_MASK_S_PER_INTERMEDIATE = 6e-9
_MASK_S_PER_OUTPUT = 25e-9
_BF16_GEMM_S_PER_FLOP = 6e-12  # bf16 bmm (oneDNN, AMX where the CPU has it); the grouped variant's w13 products
_GATHER_S_PER_ELEMENT = {"hpu-gather": 12e-9, "plain-gather": 6e-9, "hpu-grouped": 3e-9}
_GROUPED_S_PER_ROW_ELEMENT = 4e-9  # the inputs gathered into blocks (bf16), the write-back (index_add_, copies)
_REFERENCE_S_PER_GROUP = 1e-3  # per (slot, expert) group and slice: Python, indexing, the alignment


def predicted(w: MoEWorkload) -> tuple[int, float]:
    """(extra bytes, seconds per call) the skip rule uses."""
    k, n, s = w.in_width, w.out_width, w.slices
    prepared = stack_elements(w) * 4  # the HPU variants' float32 copies of the stacks, cached
    if w.implementation == "hpu-mask":
        p = padded_pairs(w)
        per_slice = p * virtual_columns(w) * 4 * 3 + p * n * 4 * 3 + p * k * 6
        secs = (mask_flops(w) * _GEMM_S_PER_FLOP + p * virtual_columns(w) * s * _MASK_S_PER_INTERMEDIATE
                + p * n * s * _MASK_S_PER_OUTPUT)
        return prepared + per_slice, secs
    if w.implementation == "hpu-grouped":
        # No cached copy. bf16 operands: the inputs gathered into blocks and each block's weights gathered in
        # bf16, both bmm in bf16 (float32 accumulation); w2's expand in float32 on upcast B blocks (the routing
        # weight is applied before the delta is rounded). One slice's delta alive at a time, added into a
        # bf16 scratch copy of the output columns (grouped_moe, writeback.merge_blocks).
        p, layout = padded_pairs(w), block_layout(w)
        weighted = w.op == "w2"
        per_slice = (layout.blocks * w.rank * (k * 2 + n * (6 if weighted else 2)) + layout.positions * w.rank * 2
                     + layout.positions * n * (6 if weighted else 2) + p * n * 2 * 2)
        secs = (grouped_static_flops(w) * (_GEMM_S_PER_FLOP + _BF16_GEMM_S_PER_FLOP) / 2
                + grouped_gathered_elements(w) * _GATHER_S_PER_ELEMENT["hpu-grouped"]
                + (layout.blocks * w.rank * n * s * _GATHER_S_PER_ELEMENT["hpu-grouped"] if weighted else 0)
                + (layout.positions * (k + n * s) + p * n * s) * _GROUPED_S_PER_ROW_ELEMENT)
        return layout.positions * k * 2 + per_slice, secs
    if w.implementation == "hpu-gather":
        p = padded_pairs(w)
        return prepared + p * w.rank * max(k, n) * 4 + p * n * 4 * 3 + p * k * 6, gathered_elements(w) * _GATHER_S_PER_ELEMENT[w.implementation]
    if w.implementation == "plain-gather":
        p = served_pairs(w)
        return p * w.rank * max(k, n) * (2 + 4) + p * n * 4 * 2 + p * k * 4, gathered_elements(w) * _GATHER_S_PER_ELEMENT[w.implementation]
    # The reference: one (slot, expert) group at a time, so a few [group pairs, N] temporaries.
    groups = max(1, min(w.adapters * w.experts, served_pairs(w)))
    acc = 8 if w.implementation == "reference-f64" else 4
    extra = 4 * acc * -(-served_pairs(w) // groups) * (k + n) + 16 * 2**20
    return extra, grouped_flops(w) * 2 * _GEMM_S_PER_FLOP + groups * s * _REFERENCE_S_PER_GROUP


def skip_reason(w: MoEWorkload, plan: Plan) -> str | None:
    extra, secs = predicted(w)
    if input_bytes(w) + extra > plan.memory_cap:
        return (f"memory: inputs {size(input_bytes(w))} + predicted extra {size(extra)} exceed the "
                f"{size(plan.memory_cap)} cap")
    if secs > plan.seconds_cap:
        return f"time: predicted {secs:.0f} s per call (cap {plan.seconds_cap:.0f} s)"
    return None


# -- running -----------------------------------------------------------------------------------


def workloads(plan: Plan):
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            for tokens in plan.tokens:
                for implementation in plan.implementations:
                    yield MoEWorkload(model, hidden, intermediate, experts, top_k, op, tokens, implementation,
                                      plan.adapters, plan.rank)


def _measure_in_child(args):
    from .measure import measure
    from .moe_workload import build

    return measure(*args, builder=build)


def gemm_rate(threads: int, size_: int = 2048, repeats: int = 3) -> float:
    """This machine's float32 GEMM rate now (FLOP/s, median of a few ``size_``² products), to read the mask
    variant's rate against."""
    import statistics
    import time

    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size_, size_), torch.randn(size_, size_)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size_**3 / statistics.median(times)


def run(plan: Plan, threads: int, in_process: bool = False, log=print) -> tuple[list, list]:
    """Measure every kept workload; return (results, skipped), each a list of (workload, dict|reason)."""
    skipped, todo = [], []
    for w in workloads(plan):
        reason = skip_reason(w, plan)
        (skipped if reason else todo).append((w, reason))
    if in_process:  # the smoke test: tiny shapes, no fork server
        from .measure import measure
        from .moe_workload import build

        return [(w, measure(w, threads, builder=build)) for w, _ in todo], skipped
    return measure_each(todo, threads, _measure_in_child, "benchmarks.moe_preload", "moe", lambda w: f"{w.model} {w.op} T={w.tokens} {w.implementation}", log), skipped


# -- the report --------------------------------------------------------------------------------


def _cell(result: dict | None, skipped: str | None) -> str:
    if skipped:
        return "not run¹"
    if result is None:
        return "–"
    if "error" in result:
        return "error²"
    return f"{seconds(result['seconds'])} · {size(result['peak_extra_bytes'])}"


def _ratio(num: dict | None, den: dict | None) -> str:
    if num and den and "seconds" in num and "seconds" in den and den["seconds"] > 0:
        return f"{num['seconds'] / den['seconds']:.1f}×"
    return "–"


def _flops(value: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} FLOP"


def report(results: list, skipped: list, plan: Plan, command: str, machine_lines: list[str],
           wall_s: float | None = None, gemm_flops: float | None = None) -> list[str]:
    """The markdown of docs/benchmarks-moe.md (``wall_s``: the whole run; ``gemm_flops``: :func:`gemm_rate`)."""
    measured = {w: r for w, r in results}
    not_run = {w: reason for w, reason in skipped}
    impls = plan.implementations
    lines = ["# Benchmarks: the MoE LoRA ops at Mixtral, Qwen3-MoE, DeepSeek-V3 and gpt-oss shapes", "",
             "Written by `" + command + "` (the dense LoRA ops: [benchmarks.md](benchmarks.md); the MoE "
             "semantics: [moe.md](moe.md); what the HPU numbers mean for a Gaudi: [hpu.md](hpu.md), *MoE*).", "",
             *machine_lines,
             *([f"- float32 GEMM rate at the start (2048² products, same threads): {gemm_flops / 1e9:.0f} GFLOP/s"]
               if gemm_flops else []),
             *([f"- wall time of the whole run: {wall_s / 60:.1f} min"] if wall_s is not None else []), "",
             *_subset_note(plan),
             "What is timed: one call of the wrapper method of docs/moe.md's contract, `add_lora_w13(y [T, top_k, 2I], "
             "x [T, H], …)` (gate and up as two slices of I, no routing weight) or `add_lora_w2(y [T, top_k, H], "
             f"x [T·top_k, I], …)` (one slice, routing weights applied), after `update_metadata`; L = {plan.adapters} "
             f"adapter slots, rank {plan.rank}, stacks `[L, E, R, K]` / `[L, E, N, R]` with every expert distinct. "
             "Tokens: 16 contiguous sequences (one token each below 16) cycling slots −1, 0, …, L−1, so a quarter "
             "of the tokens have no adapter (T = 1 uses slot 0); each token routed to top_k distinct experts drawn "
             "at random (seeded), weights a softmax of random logits, every adapter enabled, no expert map.", "",
             "Implementations: `reference-f64`: the golden reference (`PunicaWrapperReference`: "
             "`moe_lora_align_block_size` then `fused_moe_lora`, one matrix product per (slot, expert) group) "
             "with every input in float64; `reference-f32`: the same code with bfloat16 inputs, so float32 "
             "accumulation; `hpu-grouped`: the suite's Gaudi implementation on the CPU (`hpu-emulated`, its "
             "default MoE variant, `conformance/targets/hpu/grouped_moe.py`): the pairs sorted by (slot, expert) into "
             "blocks of a static layout per bucket, one bf16 weight gather per block, two `bmm` over the blocks in bf16 "
             "(float32 accumulation; w2's expand in float32 for the routing weight), the block rows added into "
             "their pairs' output rows (`index_add_`); "
             "`hpu-mask`: the same target with `moe_variant=\"mask\"`: every "
             "(token, choice) pair a row, every (slot, expert) a virtual slot of the dense mask LoRA, GEMMs over "
             "all L·E·R columns; `hpu-gather`: its index_select variant (`hpu-emulated-gather`), each padded pair's "
             "(slot, expert) weights copied out; `plain-gather`: the comparison baseline "
             "(`benchmarks.moe_workload.PlainGather`), each served pair's A and B gathered and upcast, then "
             "`bmm`. All but `reference-f64` get bfloat16 inputs and accumulate in float32.", "",
             "Each cell: median time of warm calls (5 repetitions, 3 when a call takes over 1 s, 1 over 5 s; after "
             "one first call) · peak extra memory of the first call (each measurement in a fresh process; `VmHWM` "
             "after the first call minus `VmRSS` before it, as in benchmarks.md; it includes the HPU variants' "
             "float32 copies of the stacks, made once per adapter set). Pairs: T·top_k, and how many belong to "
             "tokens with an adapter. Grouped FLOPs: 2·P_served·R·(K + N)·slices, the LoRA work itself (the FLOP "
             "floor); mask FLOPs: 2·P_pad·L·E·R·(K + N)·slices, what the mask variant's GEMMs do; grouped static "
             "FLOPs: 2·B·b·R·(K + N)·slices, what the grouped variant's `bmm` do over its B blocks of b positions "
             "(`grouped_moe.block_shape`, shown as B × b).", ""]
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            what = f"H {hidden} → 2 × I {intermediate}" if op == "w13" else f"I {intermediate} → H {hidden}"
            lines += [f"## {model} {op}: {what}, E = {experts}, top-{top_k}, L·E·R = {plan.adapters * experts * plan.rank}", ""]
            rows = []
            for tokens in plan.tokens:
                w0 = MoEWorkload(model, hidden, intermediate, experts, top_k, op, tokens, impls[0], plan.adapters, plan.rank)
                cells = [_cell(measured.get(replace(w0, implementation=i)), not_run.get(replace(w0, implementation=i)))
                         for i in impls]
                get = {i: measured.get(replace(w0, implementation=i)) for i in impls}
                layout = block_layout(w0)
                rows.append([tokens, f"{w0.pairs} ({served_pairs(w0)})", *cells,
                             _ratio(get.get("hpu-grouped"), get.get("reference-f32")),
                             _ratio(get.get("hpu-grouped"), get.get("hpu-gather")),
                             _ratio(get.get("hpu-mask"), get.get("reference-f32")),
                             _flops(grouped_flops(w0)),
                             f"{_flops(grouped_static_flops(w0))} ({grouped_static_flops(w0) / max(grouped_flops(w0), 1):.2f}×, "
                             f"{layout.blocks} × {layout.block})",
                             f"{_flops(mask_flops(w0))} ({mask_flops(w0) / max(grouped_flops(w0), 1):.0f}×)"])
            lines += table(["T", "pairs (served)", *impls, "grouped ÷ ref-f32", "grouped ÷ hpu-gather", "mask ÷ ref-f32",
                            "grouped FLOPs", "grouped static FLOPs (× grouped, B × b)", "mask FLOPs (× grouped)"], rows) + [""]
    lines += ["¹ not run; the reason is listed below. ² the implementation raised; listed below.", ""]
    lines += _goals(results, plan)
    lines += _sizes(plan)
    lines += _findings(results, plan, gemm_flops)
    lines += ["## Not run, and why", "",
              "The skip rule's model (`benchmarks/moe.py`): the mask variant's GEMM FLOPs at ~40 GFLOP/s plus "
              "its elementwise passes, the gathers' copied weight elements at a calibrated cost each, the "
              "reference's matrix products and a fixed cost per (slot, expert) group. Caps: inputs + predicted "
              f"extra ≤ {size(plan.memory_cap)} (the machine is shared, 24 GiB), predicted time ≤ "
              f"{plan.seconds_cap:.0f} s per call.", ""]
    lines += table(["model", "op", "T", "implementation", "reason"],
                   [[w.model, w.op, w.tokens, w.implementation, reason] for w, reason in skipped]) if skipped else ["none: every combination fits both caps."]
    errors = [(w, r["error"]) for w, r in results if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {w.model} {w.op} T={w.tokens} {w.implementation}: {e}" for w, e in errors]
    return lines + [""]


def _subset_note(plan: Plan) -> list[str]:
    """Say so when the run measured less than the full plan, and how to run the rest."""
    missing = []
    if [m for m, *_ in plan.shapes] != [m for m, *_ in FULL.shapes]:
        missing.append("models " + ", ".join(m for m, *_ in FULL.shapes if m not in [n for n, *_ in plan.shapes]))
    if plan.tokens != FULL.tokens:
        missing.append("T " + ", ".join(str(t) for t in FULL.tokens if t not in plan.tokens))
    if plan.implementations != FULL.implementations:
        missing.append("implementations " + ", ".join(i for i in FULL.implementations if i not in plan.implementations))
    if not missing:
        return []
    return [f"**A reduced run** (not measured here: {'; '.join(missing)}). The full run, to be repeated on a quiet "
            "machine: `python -m benchmarks moe`.", ""]


GOAL_RATIO_TO_REFERENCE = 3.0  # grouped ÷ reference-f32 at T ≥ 64
GOAL_STATIC_FLOPS = 2.0  # grouped static FLOPs ÷ grouped FLOPs
GOAL_DECODE_RATIO_TO_GATHER = 2.0  # grouped ÷ hpu-gather at T = 1


def _goals(results: list, plan: Plan) -> list[str]:
    """The grouped variant against the goals of its issue, cell by cell: met, missed, or – (not measured)."""
    by = {(w.model, w.op, w.tokens, w.implementation): r for w, r in results if "seconds" in r}
    lines = ["## The grouped variant against its goals", "",
             f"At T ≥ 64: time within {GOAL_RATIO_TO_REFERENCE:.0f}× the reference's float32 grouped time (`reference-f32`) "
             f"and static FLOPs at most {GOAL_STATIC_FLOPS:.0f}× the grouped FLOPs; at T = 1: time within "
             f"{GOAL_DECODE_RATIO_TO_GATHER:.0f}× `hpu-gather`'s; peak extra memory below `hpu-gather`'s.", ""]

    def verdict(value: float | None, limit: float, text: str) -> str:
        if value is None:
            return "–"
        return f"{text} {'met' if value <= limit else '**missed**'}"

    rows = []
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            for tokens in plan.tokens:
                w = MoEWorkload(model, hidden, intermediate, experts, top_k, op, tokens, "hpu-grouped", plan.adapters, plan.rank)
                grouped, ref, gather = (by.get((model, op, tokens, i)) for i in ("hpu-grouped", "reference-f32", "hpu-gather"))
                ratio = grouped["seconds"] / ref["seconds"] if grouped and ref else None
                decode = grouped["seconds"] / gather["seconds"] if grouped and gather else None
                flops = grouped_static_flops(w) / max(grouped_flops(w), 1)
                memory = grouped["peak_extra_bytes"] / max(gather["peak_extra_bytes"], 1) if grouped and gather else None
                rows.append([model, op, tokens,
                             verdict(ratio, GOAL_RATIO_TO_REFERENCE, f"{ratio:.1f}×" if ratio else "") if tokens >= 64 else "",
                             verdict(flops, GOAL_STATIC_FLOPS, f"{flops:.2f}×") if tokens >= 64 else "",
                             verdict(decode, GOAL_DECODE_RATIO_TO_GATHER, f"{decode:.1f}×" if decode else "") if tokens == 1 else "",
                             verdict(memory, 1.0, f"{size(grouped['peak_extra_bytes'])} vs {size(gather['peak_extra_bytes'])}")
                             if memory is not None else "–"])
    lines += table(["model", "op", "T", "grouped ÷ ref-f32", "static ÷ grouped FLOPs", "grouped ÷ hpu-gather (T = 1)",
                    "peak extra: grouped vs hpu-gather"], rows)
    return lines + [""]


def _sizes(plan: Plan) -> list[str]:
    """What each shape holds, and what the largest T asks of each implementation: the skip rule's inputs."""
    big = max(plan.tokens)
    lines = ["## What fits", "",
             f"Sizes at the largest T = {big} (predicted extra memory from the skip rule's model; the measured "
             "peaks are in the tables above). The stacks alone are L·E·R·(K + N)·slices elements; the mask "
             "variant holds a few `[P_pad, L·E·R]` float32 intermediates per slice, the gathers a copy of every "
             "pair's weights (`[P, R, K]` and `[P, N, R]`, one slice at a time).", ""]
    rows = []
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            def w(impl, _m=model, _h=hidden, _i=intermediate, _e=experts, _k=top_k, _op=op):
                return MoEWorkload(_m, _h, _i, _e, _k, _op, big, impl, plan.adapters, plan.rank)
            base = w("hpu-mask")
            rows.append([model, op, size(stack_elements(base) * 2), size(stack_elements(base) * 8),
                         size(input_bytes(w("reference-f64"))), size(input_bytes(base)),
                         size(padded_pairs(base) * virtual_columns(base) * 4),
                         size(padded_pairs(base) * base.rank * max(base.in_width, base.out_width) * 4),
                         *(size(predicted(w(i))[0]) for i in plan.implementations)])
    lines += table(["model", "op", "stacks bf16", "stacks f64", "inputs f64", "inputs bf16", "[P_pad, L·E·R] f32",
                    "gathered weights per slice f32", *(f"{i} extra" for i in plan.implementations)], rows)
    lines += ["", f"The largest T (a power of two) each implementation fits by the same model: inputs + predicted "
              f"extra ≤ {size(plan.memory_cap)} and ≤ {plan.seconds_cap:.0f} s per call (what limits it in brackets).", ""]
    rows = []
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            cells = []
            for impl in plan.implementations:
                t, limit = largest_tokens(MoEWorkload(model, hidden, intermediate, experts, top_k, op, 1, impl,
                                                      plan.adapters, plan.rank), plan)
                cells.append(f"{t} ({limit})" if t else f"none ({limit})")
            rows.append([model, op, *cells])
    lines += table(["model", "op", *plan.implementations], rows)
    return lines + [""]


def largest_tokens(w: MoEWorkload, plan: Plan, limit: int = 2**20) -> tuple[int, str]:
    """(the largest power-of-two T within both caps, "memory" or "time": what stops the next one)."""
    best, tokens = 0, 1
    while tokens <= limit:
        reason = skip_reason(replace(w, tokens=tokens), plan)
        if reason:
            return best, reason.split(":")[0]
        best, tokens = tokens, tokens * 2
    return best, f"> {limit}"


def _findings(results: list, plan: Plan, gemm_flops: float | None = None) -> list[str]:
    """The comparisons the HPU section of docs/hpu.md cites, read off the measured numbers."""
    by = {(w.model, w.op, w.tokens, w.implementation): r for w, r in results if "seconds" in r}
    big = max(plan.tokens)
    machine = f" ({gemm_flops / 1e9:.0f} GFLOP/s at the start of this run)" if gemm_flops else ""
    lines = ["## Findings", "",
             f"At T = {big}: the mask variant's time against the grouped reference (same bf16 inputs) and the "
             "gathers, and the rate its dense GEMMs reach (mask FLOPs ÷ time): a rate near the machine's float32 "
             f"GEMM rate{machine} means the variant is bound by the L·E·R-wide GEMMs, not by overhead.", ""]
    rows = []
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            w0 = MoEWorkload(model, hidden, intermediate, experts, top_k, op, big, "hpu-mask", plan.adapters, plan.rank)
            get = {i: by.get((model, op, big, i)) for i in plan.implementations}
            mask = get.get("hpu-mask")
            rate = f"{mask_flops(w0) / mask['seconds'] / 1e9:.0f} GFLOP/s" if mask else "–"
            rows.append([model, op, *(seconds(get[i]["seconds"]) if get.get(i) else "–" for i in plan.implementations),
                         _ratio(mask, get.get("reference-f32")), _ratio(mask, get.get("hpu-gather")),
                         _ratio(mask, get.get("plain-gather")), rate])
    lines += table(["model", "op", *plan.implementations, "mask ÷ ref-f32", "mask ÷ hpu-gather", "mask ÷ plain-gather",
                    "mask GEMM rate"], rows)
    small = min(plan.tokens)
    lines += ["", f"At T = {small} (decode): whatever T is, every call of the mask variant reads the float32 flattened "
              "stacks of every (slot, expert), L·E·R·(K + N) elements per slice, and writes and reads a copy of "
              "LoRA-B with the unused virtual slots zeroed (`torch.where(used_columns, b_flat, 0)` in "
              "`mask_math.expand`, L·E·R·N elements): the bytes below, per call, T-independent. The gathers "
              "touch only the pairs' own weights.", ""]
    rows = []
    for model, hidden, intermediate, experts, top_k in plan.shapes:
        for op in plan.ops:
            w0 = MoEWorkload(model, hidden, intermediate, experts, top_k, op, small, "hpu-mask", plan.adapters, plan.rank)
            get = {i: by.get((model, op, small, i)) for i in plan.implementations}
            per_call = virtual_columns(w0) * (w0.in_width + 3 * w0.out_width) * 4 * w0.slices
            rows.append([model, op, *(seconds(get[i]["seconds"]) if get.get(i) else "–" for i in plan.implementations),
                         _ratio(get.get("hpu-mask"), get.get("hpu-gather")), size(per_call),
                         size(gathered_elements(replace(w0, implementation="hpu-gather")) * 4)])
    lines += table(["model", "op", *plan.implementations, "mask ÷ hpu-gather", "mask: stack bytes per call",
                    "hpu-gather: gathered bytes"], rows)
    return lines + [""]
