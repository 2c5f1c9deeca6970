"""``python -m conformance.targets list``: every known target and whether it can run here.

``python -m conformance.targets describe NAME``: every op × dtype of one target with its status
(implemented, derived from which kernels, or not supported and why); see ``describe.py``.
"""

from __future__ import annotations

import argparse
import sys

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
    args = parser.parse_args(argv)
    if args.command == "describe":
        try:
            print(render(describe(args.name)))
        except TargetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    statuses = list_targets()
    width = max(len(status.name) for status in statuses)
    for status in statuses:
        print(f"{status.name:{width}} {'usable' if status.usable else 'unavailable':11} {status.reference}")
        if not status.usable:
            print(f"{'':{width}} {status.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
