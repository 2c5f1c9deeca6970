"""``python -m conformance.caselists write|check [NAME ...]``: the maintainer's commands for the shipped lists.

    write [NAME ...] [--seed N] [--out DIR]   draw the named profiles (default: every profile) and write
                                              DIR/NAME.jsonl (default DIR: the package's caselists/)
    check [NAME ...]                          draw each shipped list's profile again and compare: the same ids,
                                              cases and input digests, or exit 1 naming the first difference

A list is regenerated when the suite changes what a case is or how its values are drawn (a new family, a
new op): the new list is a new release's list, and bundles of the old one verify only against the old
release (docs/certification.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.generator import PROFILES

from .caselist import CASELISTS_DIR, CaselistError, load_caselist, released_caselists, write_caselist
from .freeze import freeze


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.caselists", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("write", "check"))
    parser.add_argument("names", nargs="*", help=f"profiles / lists (default: every one: {', '.join(PROFILES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=CASELISTS_DIR)
    args = parser.parse_args(argv)
    names = args.names or list(PROFILES)
    unknown = [name for name in names if name not in PROFILES]
    if unknown:
        parser.error(f"unknown profile(s) {unknown}; a list is frozen from one of {', '.join(PROFILES)}")
    if args.command == "write":
        args.out.mkdir(parents=True, exist_ok=True)
        for name in names:
            header, entries = freeze(name, args.seed)
            written = write_caselist(args.out / f"{name}.jsonl", name, header, entries)
            print(f"{written.path}: {len(written.entries)} cases, {written.digest}")
        return 0
    failed = False
    for name in names:
        try:
            shipped = load_caselist(released_caselists().get(name, name))
        except CaselistError as exc:
            print(f"{name}: {exc}")
            failed = True
            continue
        difference = _difference(shipped, freeze(shipped.profile, shipped.seed)[1])
        print(f"{name}: {difference or f'the same {len(shipped.entries)} cases, ids and input digests as drawn here'}")
        failed |= difference is not None
    return 1 if failed else 0


def _difference(shipped, drawn) -> str | None:
    """The first difference between a shipped list's entries and a fresh drawing's, or None."""
    if len(shipped.entries) != len(drawn):
        return f"the list holds {len(shipped.entries)} cases, the drawing {len(drawn)}"
    for listed, fresh in zip(shipped.entries, drawn):
        for what, a, b in (("id", listed.case_id, fresh.case_id), ("case", listed.case_json, fresh.case_json),
                           ("inputs digest", listed.inputs_digest, fresh.inputs_digest)):
            if a != b:
                return f"case {listed.case_id}: its {what} differs from the drawing's ({fresh.case_id})"
    return None


if __name__ == "__main__":
    sys.exit(main())
