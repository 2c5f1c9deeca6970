"""How close correct targets come to the systematic-error threshold: the margins in docs/verdict.md.

    .venv/bin/python tests/calibration_systematic.py --seeds 1-1000 --families random
    .venv/bin/python tests/calibration_systematic.py --seeds 1-200 --families positive,scaled,t1,no_add_inputs
    .venv/bin/python tests/calibration_systematic.py --seeds 1-5 --profile standard

Each run seed draws, for every op × dtype judged against the oracle, one case of each family named
(standard-profile limits, the seed of a combination as the profiles derive it), or with ``--profile``
that profile's whole case list. Every case runs on the correct targets that round differently from
the reference (``CORRECT_TARGETS``: the mask-based plain target, both emulated Gaudi variants, the
reference computing in float32, the Gaudi-like activation-dtype intermediate on the fused wrappers,
the two MoE variants on the MoE ops), and each result is judged by ``conformance.verdict.judge`` as
``run_case`` judges it, with the reference's three runs shared between the targets. It prints, per
output dtype and per target, the largest ``systematic_ratio`` (|α| / threshold: 1 is flagged), the
largest significance (|α| / SE) and the largest |α|, each with its case, then every result flagged
(a correct target must have none) and the largest budget ratio.
``tests/verdict/test_systematic_calibration.py`` holds CI to a few of these seeds.
"""

from __future__ import annotations

import argparse
import time
import zlib
from dataclasses import dataclass, field

import torch
from calibration_ratios import seed_range
from fault_targets import (
    ActivationDtypeIntermediateTarget,
    Float32IntermediateTarget,
    Float32ReferenceTarget,
    PlainTorchTarget,
    WeightAfterRoundingTarget,
)

from conformance import hypothesis_profile
from conformance.cases.case import DTYPES, Case
from conformance.generator.limits import STANDARD_LIMITS
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.runner import as_float64, execute, make_values, oracle_delta, oracle_magnitude
from conformance.targets.reference import ReferenceTarget
from conformance.targets.registry import load
from conformance.verdict import FailureKind, judge

MOE_OPS = frozenset(op for op, spec in OP_SPECS.items() if "routing" in spec.knobs)
FUSED_WRAPPERS = frozenset({"add_lora_linear", "add_lora_logits"})


def correct_targets() -> list[tuple[object, frozenset[str] | None]]:
    """``(target, the ops it runs)``: a variant runs only where it rounds differently from the plain target."""
    return [
        (PlainTorchTarget(), None),
        (load("hpu-emulated"), None),
        (load("hpu-emulated-gather"), None),
        (Float32ReferenceTarget(), None),
        (ActivationDtypeIntermediateTarget(), FUSED_WRAPPERS),
        (Float32IntermediateTarget(), MOE_OPS),
        (WeightAfterRoundingTarget(), MOE_OPS),
    ]


def family_cases(run_seed: int, families: list[str]) -> list[tuple[str, Case]]:
    """One case of each of ``families`` per op × dtype (where it applies), standard-profile limits."""
    from conformance.generator.drawing import draw_examples  # Hypothesis, only where cases are drawn
    from conformance.generator.families import families_for
    from conformance.generator.strategies import cases

    drawn = []
    for op, spec in OP_SPECS.items():
        if spec.check is not None:  # judged by invariants: no oracle, no delta
            continue
        for dtype in DTYPES:
            applicable = {family.name for family in families_for(spec, dtype)}
            for family in families:
                if family in applicable:
                    combination_seed = zlib.crc32(f"{op}/{dtype}/{family}".encode()) ^ run_seed
                    for case in draw_examples(cases(spec, dtype, family, STANDARD_LIMITS), 1, combination_seed, False):
                        drawn.append((case.case_id, case))
    return drawn


@dataclass
class Largest:
    """The largest value seen and where."""

    value: float = 0.0
    where: str = ""

    def offer(self, value: float, where: str) -> None:
        if value > self.value:
            self.value, self.where = value, where


@dataclass
class Tally:
    ratio: Largest = field(default_factory=Largest)  # systematic_ratio
    significance: Largest = field(default_factory=Largest)
    bias: Largest = field(default_factory=Largest)  # |α|
    budget_ratio: Largest = field(default_factory=Largest)
    results: int = 0


def measure(cases_of_seed, seeds: list[int], targets=None, observe=None) -> tuple[dict[tuple[str, str], Tally], list[str], int]:
    """``({(target, dtype): Tally}, flagged results, cases)``; the baseline is tallied as ``reference``.
    ``targets``: ``(target, the ops it runs)`` pairs, ``correct_targets()`` by default; ``observe``, if
    given, is called with ``(target name, "seedN:case-id", verdict, judged)`` for every result, ``judged``
    the arguments ``judge`` got (``calibration_precision`` reads the spread's parts from them)."""
    targets = correct_targets() if targets is None else targets
    tallies: dict[tuple[str, str], Tally] = {}
    flagged: list[str] = []
    cases_run = 0
    cpu = torch.device("cpu")
    for seed in seeds:
        for case_id, case in cases_of_seed(seed):
            spec = OP_SPECS[case.op]
            if spec.check is not None:
                continue
            cases_run += 1
            values = make_values(case)
            reference = ReferenceTarget()
            oracle = execute(spec, case, as_float64(values), reference, cpu)[spec.output]
            baseline = execute(spec, case, values, reference, cpu, update_metadata=False)[spec.output]
            delta = oracle_delta(spec, case, values, reference)
            magnitude = oracle_magnitude(spec, case, values, reference)
            initial, written = values[spec.output], spec.written_mask(case)
            results = [("reference", baseline)]
            for target, ops in targets:
                if (ops is None or case.op in ops) and target.unsupported_reason(case) is None:
                    try:
                        results.append((target.name, execute(spec, case, values, target, target.device)[spec.output]))
                    except Exception as exc:  # noqa: BLE001 - a real target's known raise (conformance/expectations/cpu.toml): listed
                        flagged.append(f"{target.name} seed{seed}:{case_id}: [{FailureKind.RAISED.value}] {type(exc).__name__}: {exc}")
            for name, actual in results:
                verdict = judge(actual, oracle, baseline, initial, written, delta, magnitude)
                where = f"seed{seed}:{case_id}"
                if observe is not None:
                    observe(name, where, verdict, (actual, oracle, baseline, initial, written, delta, magnitude))
                if not verdict.passed:
                    kinds = ", ".join(problem.kind.value for problem in verdict.problems)
                    flagged.append(f"{name} {where}: [{kinds}] " + "; ".join(problem.text for problem in verdict.problems))
                m = verdict.measurement
                output_dtype = str(initial.dtype).removeprefix("torch.")  # a shrink buffer is float32
                tally = tallies.setdefault((name, output_dtype), Tally())
                tally.results += 1
                tally.budget_ratio.offer(m.budget_ratio, where)
                if m.systematic_ratio is not None:
                    tally.ratio.offer(m.systematic_ratio, where)
                    tally.significance.offer(abs(m.delta_bias) / m.delta_bias_se if m.delta_bias_se else 0.0, where)
                    tally.bias.offer(abs(m.delta_bias), where)
    return tallies, flagged, cases_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1-20", help="run seeds: a range 1-1000 or a list 1,4,9")
    parser.add_argument("--families", default="random", help="comma-separated families drawn per op × dtype")
    parser.add_argument("--profile", help="instead of --families: every case of this profile")
    args = parser.parse_args()
    hypothesis_profile.load()
    torch.set_num_threads(1)
    seeds = seed_range(args.seeds)
    if args.profile:

        def cases_of_seed(seed):
            return profile_cases(args.profile, seed)

        what = f"profile {args.profile}"
    else:
        families = args.families.split(",")

        def cases_of_seed(seed):
            return family_cases(seed, families)

        what = f"families {', '.join(families)} (standard limits)"
    started = time.perf_counter()
    tallies, flagged, cases_run = measure(cases_of_seed, seeds)
    print(f"{cases_run} cases ({what}) over run seeds {seeds[0]}–{seeds[-1]}, {time.perf_counter() - started:.0f} s")
    print(
        f"{'target':42} {'output dtype':13} {'results':>8}  {'sys. ratio':>10}  {'|α|/SE':>7}  {'max |α|':>9}  {'budget':>6}  where (largest ratio)"
    )
    for (name, dtype), t in sorted(tallies.items(), key=lambda item: (item[0][1], item[0][0])):
        print(
            f"{name:42} {dtype:13} {t.results:8}  {t.ratio.value:10.3f}  {t.significance.value:7.2f}  "
            f"{t.bias.value:9.2e}  {t.budget_ratio.value:6.3f}  {t.ratio.where}"
        )
    for dtype in sorted({dtype for _, dtype in tallies}):
        mine = {name: t for (name, d), t in tallies.items() if d == dtype}
        worst = max(mine.items(), key=lambda item: item[1].ratio.value)
        print(f"largest systematic ratio, {dtype} outputs: {worst[1].ratio.value:.3f} ({worst[0]}, {worst[1].ratio.where})")
    print(f"flagged: {len(flagged)}")
    for line in flagged:
        print("  " + line)
    systematic = sum(f"[{FailureKind.SYSTEMATIC.value}" in line for line in flagged)
    print(f"of which systematic: {systematic}")


if __name__ == "__main__":
    main()
