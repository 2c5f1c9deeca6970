"""``python -m conformance.targets list``: every known target and whether it can run here.

``python -m conformance.targets describe NAME``: every op × dtype of one target with its status
(implemented, derived from which kernels, or not supported and why); see ``describe.py``.

``python -m conformance.targets ops-table [TABLE …]``: the op, legend, composition and knob tables as
markdown blocks, generated from the specs (``conformance.ops.tables``); ``--write`` renders the
generated blocks of the docs anew, ``--check`` lists the stale ones (``conformance.ops.generated_docs``).
"""

from __future__ import annotations

import argparse
import sys

from conformance.ops import generated_docs
from conformance.ops.tables import TABLES

from .base import TargetError
from .describe import describe, render
from .registry import list_targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.targets")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the known targets and whether each can run here")
    describe_command = commands.add_parser(
        "describe", help="every op × dtype of one target: implemented, derived from which kernels, or not supported and why"
    )
    describe_command.add_argument("name", help="a registered target name or package.module:Class")
    tables_command = commands.add_parser("ops-table", help="the op, legend, composition and knob tables, generated from the specs")
    tables_command.add_argument("tables", nargs="*", metavar="TABLE", help=f"any of {', '.join(TABLES)} (default: all)")
    mode = tables_command.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"render the generated blocks of {', '.join(generated_docs.DOCS)} anew")
    mode.add_argument("--check", action="store_true", help="list the generated blocks of the docs that differ from the specs; exit 1 if any")
    args = parser.parse_args(argv)
    if args.command == "describe":
        try:
            print(render(describe(args.name)))
        except TargetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "ops-table":
        return _ops_table(args)
    statuses = list_targets()
    width = max(len(status.name) for status in statuses)
    for status in statuses:
        print(f"{status.name:{width}} {'usable' if status.usable else 'unavailable':11} {status.reference}")
        if not status.usable:
            print(f"{'':{width}} {status.reason}")
    return 0


def _ops_table(args: argparse.Namespace) -> int:
    unknown = [name for name in args.tables if name not in TABLES]
    if unknown:
        print(f"error: unknown tables {unknown}; the tables are {', '.join(TABLES)}", file=sys.stderr)
        return 2
    if args.check:
        problems = generated_docs.check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if args.write:
        for doc in generated_docs.write():
            print(f"rewrote {doc}")
        return 0
    print("\n\n".join(generated_docs.render_block(name) for name in args.tables or TABLES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
