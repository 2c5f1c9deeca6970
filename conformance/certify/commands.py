"""The two commands: ``lora-conformance certify`` (the vendor's) and ``lora-conformance verify`` (the reviewer's).

    lora-conformance certify --target=NAME --caselist NAME [--out PATH] [--statement FILE] [pytest options…]
    lora-conformance certify --from DIR [DIR ...] [--out PATH] [--statement FILE]
    lora-conformance certify --restate BUNDLE --statement FILE [--out PATH]
    lora-conformance verify BUNDLE [--rejudge N [--seed S]]

``certify`` runs the whole list (``pytest --pyargs conformance --target=NAME --caselist NAME``, with the
pytest options given, such as ``-n 2``; the report dir is ``--report-dir`` or
``reports/<target>-<list>``), or bundles runs already made (``--from``: a report dir per run, e.g. the
shards ``--shard I/N`` of one list), writes the bundle (default ``<target>-<list>-bundle.tar.gz``) and
verifies it: exit 0 conformant, 1 not conformant, 2 when no bundle could be written or it is invalid.
``--restate`` puts a filled-in statement into a bundle and indexes it again (nothing else changes).
``verify`` exits 0 conformant, 1 not conformant, 2 invalid, printing every problem it finds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import archive
from .bundle import BUNDLE, STATEMENT, CertifyError, content_members, default_out, read_inputs
from .statement import statement_findings, template

if TYPE_CHECKING:
    from .verify import Verification

# conformance.certify.verify is imported where it is used: it imports Hypothesis (through the report's HTML),
# which the run certify starts must import first, or pytest cannot rewrite its asserts and warns

# pytest options that would run less than the whole list, or another population: certify refuses them
NARROWING = ("-k", "-m", "--cases", "--shard", "--replay", "--resume", "--profile", "--seed")


def certify_parser() -> argparse.ArgumentParser:
    """``lora-conformance certify``'s own options; every other word goes to pytest (the project's tests parse
    the docs' commands with it)."""
    parser = argparse.ArgumentParser(prog="lora-conformance certify", allow_abbrev=False,
                                     description="run a released case list on a target (or bundle runs of it) and write one bundle")
    parser.add_argument("--target", help="the target to run (a registered name or module:Class)")
    parser.add_argument("--caselist", help="the released case list to run (a name in conformance/caselists/: smoke, standard)")
    parser.add_argument("--from", dest="sources", nargs="+", metavar="DIR", help="bundle these report dirs (runs or shards) instead of running")
    parser.add_argument("--restate", metavar="BUNDLE", help="put --statement into this bundle and index it again")
    parser.add_argument("--statement", metavar="FILE", help="a filled-in statement.toml to put into the bundle")
    parser.add_argument("--out", metavar="PATH", help="the bundle to write (default: <target>-<caselist>-bundle.tar.gz)")
    parser.add_argument("--report-dir", metavar="DIR", help="where the run writes its report (default: reports/<target>-<caselist>)")
    return parser


def verify_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-conformance verify", allow_abbrev=False,
                                     description="check a bundle: exit 0 conformant, 1 not conformant, 2 invalid")
    parser.add_argument("bundle", metavar="BUNDLE", help="the .tar.gz bundle certify wrote")
    parser.add_argument("--rejudge", type=int, default=0, metavar="N", help="recompute the inputs and oracle of N cases sampled from the list")
    parser.add_argument("--seed", type=int, default=None, help="the sampling seed of --rejudge (default: a random one, printed)")
    return parser


def narrowing_options(pytest_args: list[str]) -> list[str]:
    """The pytest options among ``pytest_args`` that would run less than the whole list, or other cases."""
    return [word for word in pytest_args if any(
        word == option or word.startswith(option + "=") or (len(option) == 2 and word.startswith(option) and len(word) > 2)
        for option in NARROWING)]


def certify_main(argv: list[str]) -> int:
    parser = certify_parser()
    args, pytest_args = parser.parse_known_args(argv)
    try:
        if args.restate:
            return _restate(args, pytest_args)
        if args.sources:
            if args.target or args.caselist or pytest_args:
                raise CertifyError("--from bundles runs already made: leave out --target, --caselist and pytest options "
                                   f"({' '.join(pytest_args) or 'given'})")
            documents, sources = read_inputs(args.sources)
        else:
            documents, sources = _run(args, pytest_args)
        statement = Path(args.statement).read_bytes() if args.statement else None
        members = _content(documents, sources, statement)
    except (CertifyError, archive.BundleUnreadable, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .verify import finish

    header = members[BUNDLE]
    out = Path(args.out) if args.out else default_out(documents[0].get("target") or "target", _caselist_name(header))
    members, check = finish(members)
    archive.write_archive(members, out)
    print(f"bundle: {out}")
    return report(check)


def _caselist_name(header: bytes) -> str:
    return str(json.loads(header)["caselist"]["name"])


def _content(documents: list[dict], sources: list[str], statement: bytes | None) -> dict[str, bytes]:
    """The content members, with the template statement or a given one (checked to name this bundle)."""
    members = content_members(documents, sources, b"")
    header = json.loads(members[BUNDLE])
    listed = header["caselist"]
    blank = template(str(header.get("target")), listed["name"], listed["digest"])
    if statement is not None:
        problems, _ = statement_findings(statement, header.get("target"), listed["name"], listed["digest"])
        if problems:
            raise CertifyError(f"--statement: {'; '.join(problems)}")
    members[STATEMENT] = statement if statement is not None else blank
    return members


def _run(args, pytest_args: list[str]) -> tuple[list[dict], list[str]]:
    """Run the whole list with pytest in this process; the run's results document."""
    if not args.target or not args.caselist:
        raise CertifyError("certify runs a target over a released list: give --target=NAME and --caselist NAME "
                           "(or --from DIR … to bundle runs already made)")
    narrowing = narrowing_options(pytest_args)
    if narrowing:
        raise CertifyError(f"certify runs the whole list; {' '.join(narrowing)} would run less or other cases. To shard it, run each "
                           "shard with `lora-conformance run --target=NAME --caselist NAME --shard I/N --report-dir DIR` and bundle "
                           "them with `lora-conformance certify --from DIR …`")
    import pytest

    safe = default_out(args.target, args.caselist).name.removesuffix("-bundle.tar.gz")
    report_dir = Path(args.report_dir or Path("reports") / safe)
    command = ["--pyargs", "conformance", f"--target={args.target}", "--caselist", args.caselist, "--report-dir", str(report_dir), *pytest_args]
    print(f"certify: pytest {' '.join(command)}")
    status = int(pytest.main(command))
    if not (report_dir / "results.json").is_file():
        raise CertifyError(f"the run wrote no {report_dir / 'results.json'} (pytest exit status {status}): see its output above")
    return read_inputs([report_dir])


def _restate(args, pytest_args: list[str]) -> int:
    """A bundle with another statement: its members read and checked as verify does, the statement replaced,
    the index written again."""
    if not args.statement or args.sources or args.target or pytest_args:
        raise CertifyError("--restate BUNDLE takes --statement FILE (and --out PATH) only")
    members, unsafe = archive.read_archive(args.restate)
    broken = unsafe + archive.index_problems(members)
    if broken:
        raise CertifyError(f"{args.restate} is not intact, so it cannot be restated: {'; '.join(broken)}")
    header = json.loads(members[BUNDLE])
    statement = Path(args.statement).read_bytes()
    problems, unfilled = statement_findings(statement, header.get("target"), header["caselist"]["name"], header["caselist"]["digest"])
    if problems:
        raise CertifyError(f"--statement: {'; '.join(problems)}")
    out = Path(args.out or args.restate)
    archive.write_archive(archive.with_index({**members, STATEMENT: statement}), out)
    print(f"bundle: {out} (statement {'filled' if not unfilled else 'still not filled: ' + ', '.join(unfilled)})")
    from .verify import verify_bundle

    return report(verify_bundle(out))


def verify_main(argv: list[str]) -> int:
    parser = verify_parser()
    args = parser.parse_args(argv)
    if args.rejudge < 0:
        parser.error("--rejudge takes a count of cases, 0 or more")
    from .verify import verify_bundle

    return report(verify_bundle(args.bundle, rejudge=args.rejudge, seed=args.seed))


def report(check: Verification) -> int:
    """Print every finding, the notes and the verdict line; the exit code."""
    for finding in check.findings:
        print(finding.line())
    for note in check.notes:
        print(note)
    print(f"verdict: {check.verdict.upper()}" + (f" — {check.summary}" if check.summary else ""))
    return check.exit_code
