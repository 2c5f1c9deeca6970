"""``python -m conformance.report``: render a results document, or merge shards and gate them.

    python -m conformance.report html RESULTS.json --out report.html
    python -m conformance.report merge RESULTS.json [RESULTS.json ...] --out DIR

``merge`` writes DIR/results.json and DIR/report.html, prints the verdict line and exits 0 iff the
merged gate passes (1 when it fails, 2 when the inputs cannot be merged).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from conformance.report.html import write_html_report
from conformance.report.merge import MergeError, merge_documents, read_document


def verdict_line(document: dict) -> str:
    gate = document["gate"]
    reasons = "; ".join(gate["reasons"])
    return (
        f"verdict: {'PASS' if gate['passed'] else 'FAIL'} — target {document.get('target')}, profile "
        f"{document.get('profile')}, seed {document.get('seed')}, {len(document['results'])} cases"
        + (f" ({reasons})" if reasons else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.report", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    html = commands.add_parser("html", help="render one results.json as a self-contained HTML report")
    html.add_argument("results", metavar="RESULTS.json")
    html.add_argument("--out", metavar="FILE", default="report.html", help="(default: %(default)s)")
    merge = commands.add_parser("merge", help="merge the results of shards or machines, gate them again")
    merge.add_argument("results", metavar="RESULTS.json", nargs="+")
    merge.add_argument("--out", metavar="DIR", required=True, help="where results.json and report.html go")
    args = parser.parse_args(argv)
    try:
        if args.command == "html":
            document = read_document(args.results)
            print(f"report: {write_html_report(document, args.out)}")
            return 0
        document = merge_documents([read_document(path) for path in args.results], args.results)
    except MergeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    write_html_report(document, out / "report.html")
    print(verdict_line(document))
    print(f"results: {out / 'results.json'}\nreport: {out / 'report.html'}")
    return 0 if document["gate"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
