"""``python -m conformance.targets list``: every known target and whether it can run here."""

from __future__ import annotations

import argparse

from .registry import list_targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.targets")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the known targets and whether each can run here")
    parser.parse_args(argv)
    statuses = list_targets()
    width = max(len(status.name) for status in statuses)
    for status in statuses:
        print(f"{status.name:{width}} {'usable' if status.usable else 'unavailable':11} {status.reference}")
        if not status.usable:
            print(f"{'':{width}} {status.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
