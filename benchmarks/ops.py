"""The op benchmark: every implementation at Llama-3 shapes, each measurement in a fresh process.

Plan: every (layer, T, adapters, implementation). A combination is skipped, and listed with the
reason and its predicted size, when the model below says it would not fit in memory or would take
too long; nothing is dropped silently. Each kept combination runs in its own process, forked from a
server that has imported torch, the suite and vLLM once (``multiprocessing`` ``forkserver``), so
imports cost nothing per measurement and no measurement sees another's freed memory.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, replace

from .isolated import measure_each
from .markdown import seconds, size, table
from .workload import IMPLEMENTATIONS, NO_ADAPTER, RANK, Workload, slot_per_row

# (layer, H, output slices, is lm_head). Llama-3 shapes; N = 128256 is the vocabulary.
LAYERS = [
    ("Llama-3-8B qkv", 4096, (4096, 1024, 1024), False),
    ("Llama-3-8B gate-up", 4096, (14336, 14336), False),
    ("Llama-3-8B down", 14336, (4096,), False),
    ("Llama-3-8B lm_head", 4096, (128256,), True),
    ("Llama-3-70B qkv", 8192, (8192, 1024, 1024), False),
    ("Llama-3-70B gate-up", 8192, (28672, 28672), False),
    ("Llama-3-70B down", 28672, (8192,), False),
    ("Llama-3-70B lm_head", 8192, (128256,), True),
]
TOKENS = (1, 64, 2048, 8192)
ADAPTERS = (1, 8)


@dataclass(frozen=True)
class Plan:
    layers: list
    tokens: tuple[int, ...]
    adapters: tuple[int, ...]
    implementations: tuple[str, ...]
    memory_cap: int = 11 * 2**30  # inputs + predicted extra, per measurement (the machine is shared)
    seconds_cap: float = 20.0  # predicted seconds of one call


FULL = Plan(LAYERS, TOKENS, ADAPTERS, tuple(IMPLEMENTATIONS))
QUICK = replace(FULL, layers=[LAYERS[0], LAYERS[3]], tokens=(64, 2048), adapters=(8,), seconds_cap=5.0)
SMOKE_TEST = replace(FULL, layers=[("tiny qkv", 64, (64, 16, 16), False), ("tiny lm_head", 64, (256,), True)],
                     tokens=(1, 32), adapters=(3,))


def _itemsize(implementation: str) -> int:
    return IMPLEMENTATIONS[implementation][1].itemsize


def input_bytes(w: Workload) -> int:
    """x, y and the stacks: T·H + T·N + L·R·(S·H + N) elements."""
    n = w.out_width
    return (w.tokens * (w.hidden + n) + w.adapters * RANK * (len(w.slices) * w.hidden + n)) * _itemsize(w.implementation)


def per_token_gather_bytes(w: Workload) -> int:
    """What gathering a weight copy per row costs (vLLM's torch ops, the gather variant): T·R·(H + N_max) float32."""
    return w.tokens * RANK * (w.hidden + max(w.slices)) * 4


# Seconds per gathered weight element, and per output element of the dense mask GEMMs, on this
# machine class at one thread (measured on the first runs; a model for skipping, not a result).
_GATHER_NS = {"vllm-cpu": 6.0, "hpu-gather": 40.0}
_MASK_NS_PER_OUTPUT_PER_SLOT = 0.15


def predicted(w: Workload) -> tuple[int, float]:
    """(extra bytes, seconds per call) the skip rule uses."""
    out = w.tokens * max(w.slices) * _itemsize(w.implementation)
    if w.implementation in _GATHER_NS:
        gathered = per_token_gather_bytes(w)
        return gathered + 2 * out, gathered / 4 * _GATHER_NS[w.implementation] * 1e-9 * len(w.slices)
    if w.implementation == "hpu-mask":  # [T, N] delta, its rounding and the write-back
        return 3 * out, w.tokens * w.out_width * w.adapters * _MASK_NS_PER_OUTPUT_PER_SLOT * 1e-9
    # The reference: rows grouped per adapter, so a delta and its sum with y for one adapter's rows.
    rows = max(Counter(s for s in slot_per_row(w.tokens, w.adapters) if s != NO_ADAPTER).values())
    return 2 * rows * max(w.slices) * _itemsize(w.implementation), 0.0


def skip_reason(w: Workload, plan: Plan) -> str | None:
    extra, secs = predicted(w)
    if input_bytes(w) + extra > plan.memory_cap:
        return (f"memory: inputs {size(input_bytes(w))} + predicted extra {size(extra)} exceed the "
                f"{size(plan.memory_cap)} cap")
    if secs > plan.seconds_cap:
        return f"time: predicted {secs:.0f} s per call (cap {plan.seconds_cap:.0f} s)"
    return None


def workloads(plan: Plan):
    for layer, hidden, slices, logits in plan.layers:
        for tokens in plan.tokens:
            for adapters in plan.adapters:
                for implementation in plan.implementations:
                    yield Workload(layer, hidden, slices, tokens, adapters, implementation, logits)


def _measure_in_child(args):
    from .measure import measure

    return measure(*args)


def run(plan: Plan, threads: int, in_process: bool = False, log=print) -> tuple[list, list]:
    """Measure every kept workload; return (results, skipped), each a list of (workload, dict|reason)."""
    skipped, todo = [], []
    for w in workloads(plan):
        reason = skip_reason(w, plan)
        (skipped if reason else todo).append((w, reason))
    if in_process:  # the smoke test: tiny shapes, no fork server
        from .measure import measure

        return [(w, measure(w, threads)) for w, _ in todo], skipped
    return measure_each(todo, threads, _measure_in_child, "benchmarks.preload", "ops", lambda w: f"{w.layer} T={w.tokens} L={w.adapters} {w.implementation}", log), skipped


def _cell(result: dict | None, skipped: str | None) -> str:
    if skipped:
        return "not run¹"
    if result is None:
        return ""
    if "error" in result:
        return "error²"
    return f"{seconds(result['seconds'])} · {size(result['peak_extra_bytes'])}"


def _linear_bytes(w: Workload) -> int:
    return w.tokens * (w.hidden + w.out_width) * 8


def _gather_bytes(w: Workload) -> int:
    return w.tokens * w.out_width * RANK * 8


def report(results: list, skipped: list, plan: Plan, command: str, machine_lines: list[str]) -> list[str]:
    """The markdown of docs/benchmarks.md."""
    measured = {w: r for w, r in results}
    not_run = {w: reason for w, reason in skipped}
    impls = plan.implementations
    lines = ["# Benchmarks: the LoRA ops at Llama-3 shapes", "",
             "Written by `" + command + "` (the suite's own timing: [benchmarks-suite.md](benchmarks-suite.md)).", "",
             *machine_lines, "",
             "What is timed: one call of the wrapper method every implementation exposes, "
             "`add_lora_linear(y, x, A, B, scale, slices)` for qkv, gate-up and down, `add_lora_logits` for "
             f"lm_head (T is then the number of sampled rows); rank {RANK}; stacks in vLLM's 4-D layout. "
             "Rows: 16 contiguous sequences (one row each below 16 rows) cycling slots −1, 0, …, L−1, so rows "
             "without adapter are mixed in (T = 1 uses slot 0); with L = 8 every adapter is used. "
             "T ≤ 64 is a decode batch, larger T a prefill (vLLM's CPU wrapper then takes its sgmv path).", "",
             "Implementations: `reference-f64`: the golden reference (`conformance.reference.PunicaWrapperReference`) "
             "with every input in float64 (the oracle); `reference-f32`: the same code with float32 inputs "
             "(the low-precision baseline path); `vllm-cpu`: vLLM's `PunicaWrapperCPU` over "
             "`vllm.lora.ops.torch_ops` (the `cpu` target); `hpu-mask` / `hpu-gather`: the suite's Gaudi "
             "implementation, dense-mask and index_select variants, on the CPU device (the `hpu-emulated` and "
             "`hpu-emulated-gather` targets). All but `reference-f64` get float32 inputs.", "",
             "Each cell: median time of warm calls (5 repetitions, 3 when a call takes over 1 s, 1 over 5 s; "
             "after one first call) · peak extra memory of the first call. Peak extra memory: each "
             "measurement runs in a fresh process (forked from a server that imported everything once); once "
             "the inputs are built, freed memory is returned to the kernel (`malloc_trim`) and the RSS "
             "high-water mark reset (`/proc/self/clear_refs`); the value is `VmHWM` after the first call minus "
             "`VmRSS` before it — `ru_maxrss`'s counter without the inputs' own peak in it. A few MiB are "
             "one-time allocations of torch itself (the floor visible at tiny T).", ""]
    for layer, hidden, slices, _ in plan.layers:
        lines += [f"## {layer}: H = {hidden} → N = {' + '.join(map(str, slices))}", ""]
        rows = []
        for w0 in (w for w in workloads(replace(plan, layers=[(layer, hidden, slices, _)], implementations=impls[:1]))):
            cells = []
            for impl in impls:
                w = replace(w0, implementation=impl)
                cells.append(_cell(measured.get(w), not_run.get(w)))
            ref, vllm = measured.get(replace(w0, implementation="reference-f64")), measured.get(replace(w0, implementation="vllm-cpu"))
            ratio = f"{vllm['seconds'] / ref['seconds']:.1f}×" if ref and vllm and "seconds" in ref and "seconds" in vllm else "–"
            rows.append([w0.tokens, w0.adapters, *cells, ratio, size(_linear_bytes(w0)), size(_gather_bytes(w0))])
        lines += table(["T", "L", *impls, "vLLM ÷ ref-f64 time", "T·(H+N)·8 B", "T·N·R·8 B"], rows) + [""]
    lines += ["¹ not run; the reason and predicted size are listed below. ² the implementation raised; listed below.", ""]
    lines += _goals(results, plan)
    lines += ["## Why the reference is fast and lean", "",
              "The reference groups rows by adapter (`conformance/reference/_grouping.py`): one matrix product "
              "per adapter present, over that adapter's rows, never a weight copy per row. So its work is the "
              "LoRA FLOPs plus one gather and one scatter of `x` and `y` rows, and its temporaries are one "
              "adapter's `[rows, N]` delta: memory in T·(H+N). vLLM's CPU torch ops and the gather variant "
              "copy each row's LoRA weights (`[T, N, R]`), hence T·N·R. The expand adds its delta in place "
              "(`y[rows, cols] += delta`, same rounding as the explicit float32/float64 sum it replaced), which "
              "saved two `[rows, N]` temporaries per adapter: at T = 2048 on Llama-3-8B gate-up, 0.66 s → "
              "0.51 s in a spot check on the same machine.", ""]
    lines += ["## Not run, and why", "",
              "Predicted extra memory: vLLM's torch ops and the gather variant copy every row's weights, "
              f"`T·R·(H + N_max)` float32 elements; the rest hold a few `[T, N]` tensors. Caps: inputs + "
              f"predicted extra ≤ {size(plan.memory_cap)} (the machine is shared, 24 GiB), predicted time ≤ "
              f"{plan.seconds_cap:.0f} s per call.", ""]
    lines += table(["layer", "T", "L", "implementation", "reason"],
                   [[w.layer, w.tokens, w.adapters, w.implementation, reason] for w, reason in skipped]) if skipped else ["none"]
    errors = [(w, r["error"]) for w, r in results if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {w.layer} T={w.tokens} L={w.adapters} {w.implementation}: {e}" for w, e in errors]
    return lines + [""]


def _goals(results: list, plan: Plan) -> list[str]:
    """The two goals for the golden reference, checked on the measured numbers."""
    by_key = {(w.layer, w.tokens, w.adapters, w.implementation): r for w, r in results if "seconds" in r}
    lines = ["## Goals", "", "**The float64 reference is at least 10× faster than vLLM's CPU torch ops at T = 2048.**", ""]
    rows = []
    for layer, *_ in plan.layers:
        for adapters in plan.adapters:
            ref, vllm = by_key.get((layer, 2048, adapters, "reference-f64")), by_key.get((layer, 2048, adapters, "vllm-cpu"))
            if ref and vllm:
                ratio = vllm["seconds"] / ref["seconds"]
                rows.append([layer, adapters, seconds(ref["seconds"]), seconds(vllm["seconds"]), f"{ratio:.1f}×", "met" if ratio >= 10 else "**missed**"])
            elif ref:
                rows.append([layer, adapters, seconds(ref["seconds"]), "not run (see below)", "–", "vLLM cannot run it here"])
    lines += table(["layer", "L", "reference-f64", "vllm-cpu", "speed-up", "goal"], rows) if rows else ["(T = 2048 not in this run)"]
    lines += ["", "**The reference's peak extra memory grows as T·(H+N), never T·N·R.** Every reference-f64 "
              "measurement with T ≥ 64, its peak extra memory divided by T·(H+N)·8 bytes and by T·N·R·8 bytes "
              "(the size a per-row weight gather would take):", ""]
    ratios = []
    for w, r in results:
        if w.implementation == "reference-f64" and w.tokens >= 64 and "seconds" in r:
            ratios.append((r["peak_extra_bytes"] / _linear_bytes(w), r["peak_extra_bytes"] / _gather_bytes(w), w))
    if ratios:
        lines += table(["", "min", "median", "max"], [
            ["extra ÷ T·(H+N)·8 B", *(f"{f([x[0] for x in ratios]):.2f}" for f in (min, statistics.median, max))],
            ["extra ÷ T·N·R·8 B", *(f"{f([x[1] for x in ratios]):.3f}" for f in (min, statistics.median, max))],
        ])
        worst = max(ratios, key=lambda x: x[0])
        lines += ["", f"Largest relative to T·(H+N): {worst[2].layer}, T = {worst[2].tokens}, L = {worst[2].adapters}. "
                  "A bounded ratio to T·(H+N) across T and N, far below 1 to T·N·R, is the goal met."]
    return lines + [""]
