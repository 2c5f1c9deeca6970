"""``python -m conformance.report``: render a results document, or merge shards and gate them.

    python -m conformance.report html RESULTS.json --out report.html
    python -m conformance.report html REPORT_DIR
    python -m conformance.report merge RESULTS.json [RESULTS.json ...] --out DIR
    python -m conformance.report allure REPORT_DIR [--out DIR] [--tools DIR]
    python -m conformance.report compare RESULTS.json RESULTS.json [...] --out DIR

``html REPORT_DIR`` rebuilds a run's results.json and report.html from what it wrote as it went (its
manifest ``run.json`` and the journals ``results/*.jsonl``): after a run that was killed, the report
says FAIL and names every case without a result (``pytest conformance --resume REPORT_DIR`` runs them).
It prints the verdict line and exits 0 iff the gate passes. ``merge`` writes DIR/results.json and
DIR/report.html, prints the verdict line and exits 0 iff the merged gate passes (1 when it fails, 2
when the inputs cannot be merged: different targets, profiles, seeds, Hypothesis versions or case
lists). ``allure`` turns
REPORT_DIR/allure-results into one self-contained REPORT_DIR/allure-report/index.html with the pinned
npm allure (``npm ci --prefix report-tools`` first), offline; it exits 2 naming what to install when
Node or that install is missing. ``compare`` reads the results of runs of different targets with the
same profile and seed (a results.json or its report dir each) and writes DIR/compare.json and
DIR/compare.html: per op × dtype each run's outcomes and budget ratios, which is closer to the
reference, the cases whose outcomes differ, those some run does not support, and whether the
end-to-end cases generated the same tokens; it exits 0, or 2 when the runs did not judge the same
cases (naming the difference).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from conformance import journal
from conformance.report.allure_html import AllureToolMissing, generate_allure_html
from conformance.report.allure_results import write_allure_results
from conformance.report.compare import CompareError, compare_documents, read_run
from conformance.report.compare_html import write_compare_html
from conformance.report.document import results_document
from conformance.report.html import write_html_report
from conformance.report.junit import write_junit
from conformance.report.merge import MergeError, merge_documents, read_document


def verdict_line(document: dict) -> str:
    gate = document["gate"]
    reasons = "; ".join(gate["reasons"])
    return (
        f"verdict: {'PASS' if gate['passed'] else 'FAIL'} — target {document.get('target_name') or document.get('target')}, profile "
        f"{document.get('profile')}, seed {document.get('seed')}, {len(document['results'])} cases"
        + (f" ({reasons})" if reasons else "")
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m conformance.report`` (also ``lora-conformance report``); the project's
    tests parse the CI examples' commands with it."""
    parser = argparse.ArgumentParser(prog="python -m conformance.report", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    html = commands.add_parser(
        "html", help="render one results.json as a self-contained HTML report, or rebuild a (killed) run's report from its dir"
    )
    html.add_argument("results", metavar="RESULTS.json|REPORT_DIR")
    html.add_argument("--out", metavar="FILE", help="(default: report.html; REPORT_DIR/report.html for a dir)")
    merge = commands.add_parser("merge", help="merge the results of shards or machines, gate them again")
    merge.add_argument("results", metavar="RESULTS.json", nargs="+")
    merge.add_argument("--out", metavar="DIR", required=True, help="where results.json and report.html go")
    allure = commands.add_parser("allure", help="generate the single-file Allure HTML report from REPORT_DIR/allure-results")
    allure.add_argument("report_dir", metavar="REPORT_DIR")
    allure.add_argument("--out", metavar="DIR", help="output folder (default: REPORT_DIR/allure-report)")
    allure.add_argument("--tools", metavar="DIR", help="the npm-installed report-tools folder (default: the checkout's)")
    compare = commands.add_parser("compare", help="compare runs of different targets over the same cases (same profile and seed)")
    compare.add_argument("results", metavar="RESULTS.json|REPORT_DIR", nargs="+")
    compare.add_argument("--out", metavar="DIR", required=True, help="where compare.json and compare.html go")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "allure":
        return _allure(args)
    if args.command == "compare":
        return _compare(args)
    try:
        if args.command == "html":
            if Path(args.results).is_dir():
                return _rebuild(Path(args.results), args.out)
            document = read_document(args.results)
            print(f"report: {write_html_report(document, args.out or 'report.html')}")
            return 0
        document = merge_documents([read_document(path) for path in args.results], args.results)
    except MergeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    write_html_report(document, out / "report.html")
    write_junit(document, out / "junit.xml")
    write_allure_results(document, out / "allure-results")
    print(verdict_line(document))
    print(f"results: {out / 'results.json'}\nreport: {out / 'report.html'}")
    return 0 if document["gate"]["passed"] else 1


def _rebuild(report_dir: Path, out: str | None) -> int:
    """results.json and report.html of the run in ``report_dir``, from its manifest and journals."""
    try:
        manifest = journal.read_manifest(report_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    document = results_document(manifest, journal.read_journals(report_dir))
    (report_dir / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    report = write_html_report(document, out or report_dir / "report.html")
    write_junit(document, report_dir / "junit.xml")  # the run's own was written at its end, if it had one
    write_allure_results(document, report_dir / "allure-results")
    print(verdict_line(document))
    if document["missing"]:
        print(f"to run the {len(document['missing'])} case(s) without a result: pytest conformance --resume {report_dir}")
    print(f"results: {report_dir / 'results.json'}\nreport: {report}")
    return 0 if document["gate"]["passed"] else 1


def _compare(args) -> int:
    try:
        comparison = compare_documents([read_run(path) for path in args.results], args.results)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(comparison, indent=1) + "\n")
    page = write_compare_html(comparison, out / "compare.html")
    print(comparison_line(comparison))
    print(f"comparison: {out / 'compare.json'}\nreport: {page}")
    return 0


def comparison_line(comparison: dict) -> str:
    summary = comparison["summary"]
    labels = " vs ".join(run["label"] for run in comparison["runs"])
    closer = ", ".join(f"{label} on {n}" for label, n in summary["closer"].items())
    judged = [entry for entry in comparison["e2e"] if entry["agree"] is not None]  # every run recorded tokens
    unknown = len(comparison["e2e"]) - len(judged)
    tokens = (
        f"; end-to-end tokens the same in {sum(1 for e in judged if e['agree'])} of {len(judged)} case(s)"
        + (f" ({unknown} without tokens in some run)" if unknown else "")
        if comparison["e2e"] else ""
    )
    return (
        f"compare: {labels}, profile {comparison['profile']}, seed {comparison['seed']}, {comparison['cases']} cases: "
        f"{summary['differing']} differ, {summary['unsupported_by_some']} not supported by some; closer to the reference "
        f"where all pass (op × dtype): {closer}, as close on {summary['as_close']}{tokens}"
    )


def _allure(args) -> int:
    try:
        index = generate_allure_html(args.report_dir, args.out, args.tools)
    except (AllureToolMissing, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"allure report: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
