"""``python -m benchmarks [all|ops|moe|suite|isolation] [--quick | --smoke-test] [--threads N] [--docs DIR]``.

* ``ops``: the LoRA ops at Llama-3 shapes → ``docs/benchmarks.md`` (about 20 min; ``--quick`` a few);
* ``moe``: the fused-MoE LoRA ops at Mixtral, Qwen3-MoE, DeepSeek-V3 and gpt-oss shapes → ``docs/benchmarks-moe.md``
  (``--quick``: T 1 and 64; ``--models``, ``--implementations``, ``--tokens``: a subset, said so in the page);
* ``suite``: the suite's wall time on hpu-emulated → ``docs/benchmarks-suite.md`` (``--quick``: smoke only);
* ``isolation``: the same cases judged with the target isolated and in-process, side by side, the ratio
  printed → ``docs/benchmarks-isolation.md`` (``--profiles``: one profile, default standard; ``--rounds``;
  ``--quick``: smoke, the op cases only);
* ``all`` (default): ops, moe and suite;
* ``--smoke-test``: tiny shapes and no suite runs, in-process, into ``--docs`` (CI checks the code path).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import isolation, machine, moe, ops, suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="?", choices=("all", "ops", "moe", "suite", "isolation"), default="all")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few-minute subset")
    mode.add_argument("--smoke-test", action="store_true", help="tiny shapes, in-process, seconds (for CI)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the op measurements (default 1: the machine is shared, and "
                             "OpenMP threads competing with other jobs for 2 cores measure the contention)")
    parser.add_argument("--docs", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    parser.add_argument("--tokens", default=None, help="ops/moe subset: T values, comma-separated (default 1,64,2048,8192)")
    parser.add_argument("--models", default=None, help="moe subset: models, comma-separated (default all of benchmarks.moe.SHAPES)")
    parser.add_argument("--seconds-cap", type=float, default=None,
                        help="moe: skip a combination whose predicted call time (skip rule's model) exceeds this (default 120)")
    parser.add_argument("--implementations", default=None,
                        help="moe subset: implementations, comma-separated (default all of benchmarks.moe_workload.IMPLEMENTATIONS)")
    parser.add_argument("--adapters", default=None, help="op subset: adapter counts, comma-separated (default 1,8)")
    parser.add_argument("--profiles", default=None, help="suite profiles, comma-separated (default smoke,standard,release)")
    parser.add_argument("--rounds", type=int, default=2, help="isolation: alternating pairs of runs per part (default 2)")
    args = parser.parse_args(argv)
    command = "python -m benchmarks " + shlex.join(argv if argv is not None else sys.argv[1:])
    args.docs.mkdir(parents=True, exist_ok=True)

    if args.part in ("all", "ops"):
        load = machine.load_average()
        plan = ops.SMOKE_TEST if args.smoke_test else ops.QUICK if args.quick else ops.FULL
        if args.tokens:
            plan = replace(plan, tokens=tuple(int(t) for t in args.tokens.split(",")))
        if args.adapters:
            plan = replace(plan, adapters=tuple(int(a) for a in args.adapters.split(",")))
        results, skipped = ops.run(plan, args.threads, in_process=args.smoke_test)
        lines = ops.report(results, skipped, plan, command, machine.describe(load, f"{args.threads} (torch.set_num_threads)"))
        (args.docs / "benchmarks.md").write_text("\n".join(lines))
        print(f"wrote {args.docs / 'benchmarks.md'}")
    if args.part in ("all", "moe"):
        load = machine.load_average()
        plan = moe.SMOKE_TEST if args.smoke_test else moe.QUICK if args.quick else moe.FULL
        if args.tokens:
            plan = replace(plan, tokens=tuple(int(t) for t in args.tokens.split(",")))
        if args.models:
            plan = replace(plan, shapes=[shape for shape in plan.shapes if shape[0] in args.models.split(",")])
        if args.implementations:
            plan = replace(plan, implementations=tuple(i for i in plan.implementations if i in args.implementations.split(",")))
        if args.seconds_cap:
            plan = replace(plan, seconds_cap=args.seconds_cap)
        start = time.perf_counter()
        gemm = None if args.smoke_test else moe.gemm_rate(args.threads)
        results, skipped = moe.run(plan, args.threads, in_process=args.smoke_test)
        lines = moe.report(results, skipped, plan, command, machine.describe(load, f"{args.threads} (torch.set_num_threads)"),
                           wall_s=time.perf_counter() - start, gemm_flops=gemm)
        (args.docs / "benchmarks-moe.md").write_text("\n".join(lines))
        print(f"wrote {args.docs / 'benchmarks-moe.md'}")
    if args.part in ("all", "suite") and not args.smoke_test:
        load = machine.load_average()
        profiles = tuple(args.profiles.split(",")) if args.profiles else ("smoke",) if args.quick else ("smoke", "standard", "release")
        measured = suite.run_all(profiles)
        lines = suite.report(measured, command, machine.describe(load, "1 per pytest process (the suite's default)"))
        (args.docs / "benchmarks-suite.md").write_text("\n".join(lines))
        print(f"wrote {args.docs / 'benchmarks-suite.md'}")
    if args.part == "isolation" and not args.smoke_test:
        load = machine.load_average()
        profile = args.profiles or ("smoke" if args.quick else "standard")
        parts = ("op cases",) if args.quick else ("op cases", "all")
        measured = isolation.run_all(profile, parts, args.rounds)
        lines = isolation.report(measured, command, machine.describe(load, "1 per pytest process (the suite's default)"))
        (args.docs / "benchmarks-isolation.md").write_text("\n".join(lines))
        isolation.print_ratios(measured)
        print(f"wrote {args.docs / 'benchmarks-isolation.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
