"""How close correct targets come to the error budget over many run seeds: the numbers in docs/verdict.md.

    .venv/bin/python tests/calibration_ratios.py --seeds 1-30 --moe

runs the smoke profile of each run seed (``--moe``: its fused-MoE cases only) on the correct targets
of ``fault_targets`` (the plain one and the variants that round elsewhere) and prints, per target, op
and dtype, the largest budget ratio and the case that reached it, then every case flagged (FAIL or
BROKEN; a correct target must have none). ``tests/verdict/test_verdict_calibration.py`` holds CI to a
few of these seeds; this is the measurement behind its ``HEADROOM``.
"""

from __future__ import annotations

import argparse

import torch
from fault_targets import Float32IntermediateTarget, PlainTorchTarget, WeightAfterRoundingTarget

from conformance import hypothesis_profile
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_NAMES, OP_SPECS
from conformance.runner import run_case
from conformance.verdict import Outcome

CORRECT_TARGETS = (PlainTorchTarget, Float32IntermediateTarget, WeightAfterRoundingTarget)
MOE_OPS = tuple(op for op in OP_NAMES if "routing" in OP_SPECS[op].knobs)


def seed_range(text: str) -> list[int]:
    """``"1-30"`` or ``"1,4,9"``."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(seed) for seed in text.split(",")]


def measure(seeds: list[int], ops: tuple[str, ...] | None) -> tuple[dict, list[str], int]:
    """``({(target, op, dtype): (largest ratio, "seedN:case-id")}, flagged cases, cases run)``."""
    targets = [cls() for cls in CORRECT_TARGETS]
    worst: dict[tuple[str, str, str], tuple[float, str]] = {}
    flagged: list[str] = []
    runs = 0
    for seed in seeds:
        for case_id, case in profile_cases("smoke", seed, ops=ops):
            for target in targets:
                result = run_case(target, case, case_id)
                runs += 1
                if result.outcome in (Outcome.FAIL, Outcome.BROKEN):
                    flagged.append(f"{target.name} seed {seed} {case_id}: {result.outcome.value}: {result.message}")
                if result.measurement is not None:
                    key = (target.name, case.op, case.dtype)
                    if result.measurement.budget_ratio > worst.get(key, (0.0, ""))[0]:
                        worst[key] = (result.measurement.budget_ratio, f"seed{seed}:{case_id}")
    return worst, flagged, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1-30", help="run seeds: a range 1-30 or a list 1,4,9")
    parser.add_argument("--moe", action="store_true", help="the fused-MoE ops only")
    args = parser.parse_args()
    hypothesis_profile.load()
    torch.set_num_threads(1)
    seeds = seed_range(args.seeds)
    worst, flagged, runs = measure(seeds, MOE_OPS if args.moe else None)
    print(f"{runs} target runs over run seeds {seeds[0]}–{seeds[-1]}")
    for (target, op, dtype), (ratio, where) in sorted(worst.items()):
        print(f"{target:36} {op:28} {dtype:9} {ratio:.3f}  {where}")
    for name in sorted({target for target, _, _ in worst}):
        print(f"largest for {name}: {max(ratio for (t, _, _), (ratio, _) in worst.items() if t == name):.3f}")
    print(f"flagged: {len(flagged)}")
    for line in flagged:
        print("  " + line)


if __name__ == "__main__":
    main()
