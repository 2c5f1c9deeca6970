"""How close correct targets come to the precision threshold: the margins in docs/verdict.md.

    cd tests && ../.venv/bin/python calibration_precision.py --seeds 1-1000 --families random
    cd tests && ../.venv/bin/python calibration_precision.py --seeds 1-200 --families positive,scaled,t1,no_add_inputs
    cd tests && ../.venv/bin/python calibration_precision.py --seeds 1 --profile standard --dump /tmp/spread.tsv
    cd tests && ../.venv/bin/python calibration_precision.py --model 1000

The cases and the correct targets are ``calibration_systematic``'s (its ``measure`` runs and judges
them), joined by the real targets that run here (``--real``: vLLM's own CPU ops and the example
backends, each where it claims the case). For every 16-bit output (the rule judges no float32 one) it
prints, per target and output dtype, the largest ``precision_ratio`` (the error's RMS over what correct
rounding gives; ``precision_threshold`` is flagged) on the cases the rule judges and on the smaller
ones it only measures, each with its case; the largest ratio per element count (where
``min_elements`` comes from); then every result flagged for precision (a correct target must have
none) and, per target and kind, the other failures (a real target's known ones:
``conformance/expectations/cpu.toml``). ``--dump`` writes every 16-bit result's parts of the spread,
one line each, to test another rule on the same runs without running them again.
``--model`` runs the rank-1 model instead (``rank_one_model``: Gaudi's two roundings of the intermediate
on a few rows, where they weigh most). ``tests/verdict/test_precision_calibration.py`` holds CI to a few
of these seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from calibration_ratios import seed_range
from calibration_systematic import Largest, correct_targets, family_cases, measure

from conformance import hypothesis_profile
from conformance.generator.profiles import profile_cases
from conformance.targets.base import TargetUnavailable
from conformance.targets.registry import load
from conformance.verdict import FailureKind
from conformance.verdict.precision import error_spread
from conformance.verdict.systematic import row_groups
from conformance.verdict.tolerances import PRECISION_THRESHOLDS

REAL_TARGETS = ("cpu", "vllm-wrapper-example", "functional-example", "full-target-example", "plain-example")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)  # element counts: the largest ratio from each up to the next


def real_targets(names) -> list[tuple[object, None]]:
    """The named registered targets that run here, each checked as the suite checks it."""
    found = []
    for name in names:
        try:
            target = load(name)
            type(target).check_available()
        except TargetUnavailable as exc:
            print(f"skipped {name}: {exc}")
            continue
        found.append((target, None))
    return found


def spread_parts(judged) -> dict | None:
    """The parts of the spread ``judge`` read (and two it does not, to try other rules on a dump): the
    written elements where the result and the oracle are finite, as ``judge`` selects them."""
    actual, oracle, baseline, initial, written, delta, magnitude = judged
    if actual.shape != oracle.shape or actual.dtype not in PRECISION_THRESHOLDS:
        return None
    a, o, b = actual[written].double(), oracle[written].double(), baseline[written].double()
    finite = torch.isfinite(a) & torch.isfinite(o)
    a, o, b = a[finite], o[finite], b[finite]
    d = delta[written].double()[finite] if delta is not None else None
    m = magnitude[written].double()[finite] if magnitude is not None else None
    if a.numel() == 0:
        return None
    s = error_spread(a, o, b, d, m, row_groups(written)[finite], actual.dtype)
    unit_roundoff = torch.finfo(actual.dtype).eps / 2
    return {
        "elements": s.elements, "rms": s.rms, "baseline_rms": s.baseline_rms, "rounded_rms": s.rounded_rms,
        "model_rms": s.model_rms,
        # not in the rule: the error before the rows' multiples of the delta are removed, and the model's
        # intermediate term alone (one relative rounding within u of a row-shared intermediate), to try other rules
        "raw_rms": math.sqrt(float(((a - o) ** 2).mean())),
        "row_rms": unit_roundoff * math.sqrt(float(((d if d is not None else o) ** 2).mean()) / 3),
    }


@dataclass
class Spreads:
    judged: Largest = field(default_factory=Largest)  # precision_ratio where the rule judges (min_elements on)
    small: Largest = field(default_factory=Largest)  # where the case is below min_elements: measured only
    results: int = 0


COLUMNS = ("target", "case", "dtype", "elements", "rms", "baseline_rms", "rounded_rms", "model_rms", "raw_rms", "row_rms")


@dataclass
class Observed:
    """What ``measure`` judged, as the precision rule sees it (``observe`` is its callback)."""

    spreads: dict[tuple[str, str], Spreads] = field(default_factory=dict)  # (target, output dtype)
    by_size: dict[tuple[str, int], Largest] = field(default_factory=dict)  # (output dtype, element-count bucket)
    precision: list[str] = field(default_factory=list)  # every result flagged for precision
    other: Counter = field(default_factory=Counter)  # (target, kind) of every other problem
    examples: dict[tuple[str, str], str] = field(default_factory=dict)  # the first case of each
    dump: object = None  # an open file for --dump, or None

    def observe(self, name, where, verdict, judged) -> None:
        m = verdict.measurement
        for problem in verdict.problems:
            if problem.kind is FailureKind.PRECISION:
                self.precision.append(f"{name} {where}: {problem.text}")
            else:
                self.other[(name, problem.kind.value)] += 1
                self.examples.setdefault((name, problem.kind.value), where)
        if m is None or m.precision_ratio is None:
            return
        dtype = str(judged[0].dtype).removeprefix("torch.")
        tally = self.spreads.setdefault((name, dtype), Spreads())
        tally.results += 1
        (tally.judged if m.precision_threshold is not None else tally.small).offer(m.precision_ratio, where)
        bucket = max(size for size in BUCKETS if size <= m.checked_elements)
        self.by_size.setdefault((dtype, bucket), Largest()).offer(m.precision_ratio, f"{name} {where}")
        if self.dump:
            parts = spread_parts(judged)
            if parts is not None:
                print("\t".join([name, where, dtype, *(f"{parts[c]:.6g}" for c in COLUMNS[3:])]), file=self.dump)


def measure_precision(cases_of_seed, seeds: list[int], targets, dump=None) -> tuple[Observed, list[str], int]:
    """``(what the precision rule saw, every result flagged (any kind, raises included), cases run)``."""
    observed = Observed(dump=dump)
    _, flagged, cases_run = measure(cases_of_seed, seeds, targets, observed.observe)
    return observed, flagged, cases_run


MODEL_SHAPES = ((1, 32, 0.1), (2, 16, 0.1), (2, 32, 0.0), (4, 16, 0.0), (4, 64, 0.0), (8, 32, 0.0))  # (rows, columns, base)
MODEL_SCALES = (4 / 3, 0.3, 1 / 3, 0.7)  # scales no 16-bit dtype holds: the second rounding is not exact


def rank_one_model(dtype: torch.dtype, rows: int, columns: int, base: float, trials: int, hidden: int = 64) -> list[tuple[float, float]]:
    """``(precision_ratio, the ratio with one multiple of the delta for the whole case)`` of Gaudi's order on
    ``trials`` rank-1 ``add_lora_linear``-like cases: ``x @ Aᵀ`` rounded to the dtype, scaled, rounded again
    (``ActivationDtypeIntermediateTarget``), against the baseline's float32 product, scaled, rounded once
    (``CAST_TYPE``); then the delta rounded and added to a base of ``base`` times its size. The few rows
    without a base are where a row's intermediate rounding weighs most."""
    from conformance.verdict import judge
    from conformance.verdict.precision import beyond_row_multiples

    gen = torch.Generator().manual_seed(rows * columns)
    ratios = []
    for trial in range(trials):
        scale = MODEL_SCALES[trial % len(MODEL_SCALES)]
        x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(dtype)
        a = (torch.randn(1, hidden, generator=gen, dtype=torch.float64) / hidden**0.5).to(dtype)
        b = torch.randn(columns, 1, generator=gen, dtype=torch.float64).to(dtype)
        y0 = (base * torch.randn(rows, columns, generator=gen, dtype=torch.float64)).to(dtype)
        delta = (x.double() @ a.double().T) * scale @ b.double().T
        product = x.float() @ a.float().T

        baseline, actual = (
            (y0.float() + (intermediate.float() @ b.float().T).to(dtype).float()).to(dtype)
            for intermediate in ((product * scale).to(dtype), (product.to(dtype).float() * scale).to(dtype))
        )
        oracle, written = y0.double() + delta, torch.ones(rows, columns, dtype=torch.bool)
        m = judge(actual, oracle, baseline, y0, written, delta).measurement
        one = torch.zeros(rows * columns, dtype=torch.long)  # one multiple for the whole case: the rows' left in
        kept = beyond_row_multiples((actual.double() - oracle).flatten(), delta.flatten(), one)
        ratios.append((m.precision_ratio, float(kept.square().mean().sqrt()) / m.expected_rms))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1-20", help="run seeds: a range 1-1000 or a list 1,4,9")
    parser.add_argument("--families", default="random", help="comma-separated families drawn per op × dtype")
    parser.add_argument("--profile", help="instead of --families: every case of this profile")
    parser.add_argument("--real", default=",".join(REAL_TARGETS), help="registered targets to add ('' for none)")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="case dtypes run (the rule judges no float32 output)")
    parser.add_argument("--model", type=int, default=0, help="instead: this many trials of the rank-1 model per shape and dtype")
    parser.add_argument("--dump", help="write every 16-bit result's spread parts here (tab-separated)")
    args = parser.parse_args()
    hypothesis_profile.load()
    torch.set_num_threads(1)
    if args.model:
        for dtype in (torch.float16, torch.bfloat16):
            for rows, columns, base in MODEL_SHAPES:
                ratios = rank_one_model(dtype, rows, columns, base, args.model)
                judged, whole = max(r for r, _ in ratios), max(w for _, w in ratios)
                print(f"rank-1 model {str(dtype).removeprefix('torch.'):9} {rows:3} rows × {columns:3}, base {base:g}: "
                      f"largest precision ratio {judged:.3f}; with one multiple for the whole case {whole:.3f} ({args.model} trials)")
        return
    seeds = seed_range(args.seeds)
    dtypes = args.dtypes.split(",")
    if args.profile:

        def cases_of_seed(seed):
            return [(i, case) for i, case in profile_cases(args.profile, seed) if case.dtype in dtypes]

        what = f"profile {args.profile}"
    else:
        families = args.families.split(",")

        def cases_of_seed(seed):
            return [(i, case) for i, case in family_cases(seed, families) if case.dtype in dtypes]

        what = f"families {', '.join(families)} (standard limits)"
    targets = correct_targets() + real_targets([name for name in args.real.split(",") if name])
    started = time.perf_counter()
    with open(args.dump, "w") if args.dump else contextlib.nullcontext() as dump:
        if dump:
            print("\t".join(COLUMNS), file=dump)
        observed, flagged, cases_run = measure_precision(cases_of_seed, seeds, targets, dump)
    print(f"{cases_run} cases ({what}) over run seeds {seeds[0]}–{seeds[-1]}, {time.perf_counter() - started:.0f} s")
    print("thresholds: " + ", ".join(f"{str(dt).removeprefix('torch.')} {t.ratio:g} from {t.min_elements} elements"
                                     for dt, t in PRECISION_THRESHOLDS.items()))
    print(f"{'target':42} {'dtype':9} {'results':>8}  {'judged':>7}  where (largest judged)  {'small':>7}  where (largest small)")
    spreads = observed.spreads
    for (name, dtype), t in sorted(spreads.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"{name:42} {dtype:9} {t.results:8}  {t.judged.value:7.3f}  {t.judged.where}  {t.small.value:7.3f}  {t.small.where}")
    for dtype in sorted({dtype for _, dtype in spreads}):
        mine = [(name, t) for (name, d), t in spreads.items() if d == dtype]
        name, worst = max(mine, key=lambda item: item[1].judged.value)
        print(f"largest judged precision ratio, {dtype} outputs: {worst.judged.value:.3f} ({name}, {worst.judged.where})")
    print("largest precision ratio by written elements (from … up to the next count):")
    for (dtype, size), largest in sorted(observed.by_size.items()):
        print(f"  {dtype:9} {size:5}  {largest.value:7.3f}  {largest.where}")
    print(f"flagged for precision: {len(observed.precision)}")
    for line in observed.precision:
        print("  " + line)
    print("other failures, per target and kind (first case):")
    for (name, kind), count in sorted(observed.other.items()):
        print(f"  {name:42} {kind:26} {count:6}  {observed.examples[(name, kind)]}")
    raised = [line for line in flagged if f"[{FailureKind.RAISED.value}]" in line]
    print(f"raised: {len(raised)}" + (f" (first: {raised[0]})" if raised else ""))


if __name__ == "__main__":
    main()
