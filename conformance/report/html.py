"""One self-contained HTML conformance report from a results document (``results.json``).

The file has inline CSS and an inline SVG plot, no script and loads nothing: it reads the same offline,
attached to a CI job or mailed to a release manager. Sections, top to bottom: the verdict with the gate
rule, its reasons and how many distinct problems the failures are, the run (target, profile, seed, suite
version, and each optional part it skipped, ``conformance.optional``), the problems (one per failure
cluster, ``conformance.report.clusters``: what it hits, the knob values it depends on, its ops and dtypes, its smallest case with a repro), the op × dtype matrix grouped by level, the coverage
(what the cases exercised per op, ``conformance.report.coverage``), the failures grouped by problem
with their repro commands, the known failures, the budget ratios per op, and the environment
fingerprint.

Elements a test (or a scraper) can query: ``id="verdict"``, ``id="problems"`` (the line "N distinct
problems", in the verdict), ``id="clusters"`` (one ``class="cluster"`` ``id="cluster-N"`` per problem,
its smallest case's repro with ``class="repro smallest"``, the knob values its failures depend on with
``class="only-with"``), ``id="matrix"``, ``id="coverage"`` (one row
per op, ``data-op``; cells ``data-feature`` / ``data-dtype``), ``id="missing"`` (the expected cases
without a result, and how to run them), ``id="failures"`` (a ``<details>`` per problem, each failure's
row with ``data-cluster`` and its kinds, ``class="kind"``, and where the target raised its traceback,
folded in ``<details class="traceback">``), ``id="known-failures"``,
``id="bit-differences"`` (cases whose untouched output or inputs came back with equal values and other
bits: a zero whose sign flipped, a NaN payload; recorded, not failed),
``id="not-applicable"`` (expectations entries whose package versions are not installed here), ``id="budget-ratios"``, ``id="environment"`` (the fingerprint: suite commit,
versions, device, driver, numerics environment variables; one column per input of a merge whose
machines differ, ``class="differs"`` on the rows that do), ``id="workers"`` (device per worker), and
``class="repro"`` on every repro command.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from html import escape
from pathlib import Path

from conformance.cases.features import FEATURE_DOCS
from conformance.ops.level import LEVEL_ORDER
from conformance.optional import skipped_parts
from conformance.report.clusters import cluster_of, document_clusters
from conformance.report.coverage import HEADLINE, document_coverage
from conformance.report.target_output import html_section as target_output_section
from conformance.text import TRACEBACK_LIMIT, safe_text
from conformance.verdict import Outcome
from conformance.verdict.bit_differences import BitDifferences
from conformance.verdict.judge import number_from_json

# Outcome → (css class, background colour). Order is the order of the legend and of a cell's badges.
OUTCOME_STYLE = {
    Outcome.PASS.value: ("pass", "#2e7d32"),
    Outcome.FAIL.value: ("fail", "#c62828"),
    Outcome.BROKEN.value: ("broken", "#6a1b9a"),
    Outcome.NOT_SUPPORTED.value: ("not-supported", "#757575"),
    Outcome.KNOWN_FAILURE.value: ("known-failure", "#ef6c00"),
    Outcome.UNEXPECTED_PASS.value: ("unexpected-pass", "#ad1457"),
}
REJECTED = (Outcome.FAIL.value, Outcome.BROKEN.value, Outcome.UNEXPECTED_PASS.value)
LEVELS = LEVEL_ORDER  # the design's order (conformance.ops.Level); other levels follow, sorted
DTYPE_ORDER = ("float32", "float16", "bfloat16")

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:1.5em auto;max-width:1200px;
 color:#212121;padding:0 1em}
h1{margin:0 0 .3em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
#verdict{padding:1em 1.4em;border-radius:8px;color:#fff}
#verdict.passed{background:#2e7d32}#verdict.failed{background:#c62828}
#verdict .word{font-size:3em;font-weight:800;letter-spacing:.05em}
#verdict ul{margin:.4em 0 0}
#problems{font-size:1.35em;font-weight:700;margin-top:.3em}
section.cluster{border:1px solid #ddd;border-left:6px solid #c62828;border-radius:4px;padding:.2em 1em .6em;margin:.6em 0}
section.cluster h3{margin:.4em 0}
details{margin:.3em 0}details>summary{cursor:pointer;font-weight:600}
td.zero{color:#bdbdbd}
#coverage{font-size:.8em}#coverage td,#coverage th{white-space:nowrap;padding:.2em .4em}
table{border-collapse:collapse;margin:.5em 0;font-size:.92em}
th,td{border:1px solid #ddd;padding:.3em .55em;text-align:left;vertical-align:top}
th{background:#f5f5f5}
tr.level th{background:#e3e8f0;font-size:1.02em}
.badge{display:inline-block;color:#fff;border-radius:3px;padding:0 .4em;margin:1px;font-size:.9em;
 white-space:nowrap}
pre.repro{background:#263238;color:#eceff1;padding:.4em .6em;border-radius:4px;white-space:pre-wrap;
 word-break:break-all;margin:.2em 0;font-size:.88em;user-select:all}
pre.traceback{background:#fafafa;border:1px solid #ddd;padding:.4em .6em;white-space:pre;overflow:auto;
 max-height:40em;margin:.2em 0;font-size:.82em}
.muted{color:#757575}.num{text-align:right;font-variant-numeric:tabular-nums}
dl.run{display:grid;grid-template-columns:max-content auto;gap:.15em 1em}dl.run dt{font-weight:600}
dl.run dd{margin:0}
tr.differs th,tr.differs td{background:#fff3e0}
""" + "".join(f".{cls}{{background:{colour}}}" for cls, colour in OUTCOME_STYLE.values())


def write_html_report(document: dict, path) -> Path:
    """Render ``document`` (the content of ``results.json``) to ``path``; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # every value is safe text already (``escaped``); backslashreplace all the same: writing never fails
    path.write_text(render_html_report(document), encoding="utf-8", errors="backslashreplace")
    return path


def render_html_report(document: dict) -> str:
    results = document.get("results") or []
    gate = document.get("gate") or {}
    clusters = document_clusters(document)
    target = document.get("target_name") or document.get("target", "?")  # the target's own name, not module:Class
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>LoRA conformance: {escaped(target)} — {'PASS' if gate.get('passed') else 'FAIL'}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>LoRA conformance report: {escaped(target)}</h1>",
        _verdict(gate, clusters),
        _run(document, results),
        _clusters(clusters, {r["op"]: r.get("level") or "other" for r in results}),
        _matrix(results),
        _coverage(document_coverage(document), _dtypes(results)),
        _missing(document),
        _failures(results, clusters, cluster_of(document)),
        _determinism(document, results),
        _end_to_end(results),
        _bit_differences(results),
        target_output_section(document),
        _known_failures(gate, results),
        _not_applicable(document),
        _budget_plot(results),
        _environment(document),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def escaped(value) -> str:
    """``value`` as HTML text; surrogates and control characters (a target's message can hold them) shown as
    backslash escapes (``conformance.text.safe_text``, nothing cut), so the page is valid UTF-8."""
    return escape("" if value is None else safe_text(value, limit=sys.maxsize))


def badge(outcome: str, text, styles: dict = OUTCOME_STYLE) -> str:
    """An outcome's coloured label (``styles``: outcome → (CSS class, colour))."""
    cls = styles.get(outcome, ("other", "#000"))[0]
    return f'<span class="badge {cls}" title="{escaped(outcome)}">{escaped(text)}</span>'


def _verdict(gate: dict, clusters: list[dict]) -> str:
    passed = bool(gate.get("passed"))
    reasons = gate.get("reasons") or []
    items = "".join(f"<li>{escaped(reason)}</li>" for reason in reasons)
    failures = sum(cluster["count"] for cluster in clusters)
    problems = ""
    if clusters:  # before any case list: how many things are wrong, not how many cases show it
        problems = (
            f'<div id="problems"><a href="#clusters" style="color:inherit">{_plural(len(clusters), "distinct problem")} '
            f"in {_plural(failures, 'failing case')}</a></div>"
        )
    return (
        f'<section id="verdict" class="{"passed" if passed else "failed"}">'
        f'<div class="word">{"PASS" if passed else "FAIL"}</div>'
        + problems
        + f'<div class="rule">gate: {escaped(gate.get("rule", ""))}</div>'
        + (f'<ul class="reasons">{items}</ul>' if items else "")
        + "</section>"
    )


def _plural(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def _counts(counts: dict) -> str:
    return ", ".join(f"{escaped(name)} {count}" for name, count in counts.items())


def _clusters(clusters: list[dict], op_levels: dict[str, str]) -> str:
    """One block per distinct problem: what it hits, where (ops by level, dtypes), and its smallest case."""
    if not clusters:
        return ""
    blocks = []
    for cluster in clusters:
        smallest = cluster.get("smallest") or {}
        by_level: dict[str, list[str]] = defaultdict(list)
        ops = cluster.get("ops") or {}
        levels = cluster.get("levels") or {}
        for op, count in ops.items():
            by_level[op_levels.get(op, "other")].append(f"{op} {count}")
        spans = "; ".join(f"{level}: {', '.join(by_level[level])}" for level in levels if by_level.get(level))
        shrunk = " (shrunk with --shrink)" if smallest.get("shrunk") else ""
        end_to_end = cluster.get("end_to_end") or 0
        explained = (
            f"<li>explains {_plural(end_to_end, 'end-to-end failure')} (their requests are the same kind of rows)</li>"
            if end_to_end else ""
        )
        others = [k for k in cluster.get("kinds") or () if k != cluster["kind"]]
        also = f" (its cases also show: {', '.join(others)})" if others else ""
        hits = cluster.get("hits") or {}
        shown = f"<li>each case on its own: {_counts(hits)}</li>" if len(hits) > 1 else ""
        only_with = cluster.get("only_with") or ()  # the knob values its failures depend on (clusters.py)
        shown += (f'<li>fails only with: <span class="only-with">{escaped("; ".join(only_with))}</span> '
                  "(its ops' passing cases show other values)</li>") if only_with else ""
        repro = f'<pre class="repro smallest">{escaped(smallest.get("repro"))}</pre>' if smallest.get("repro") else ""
        blocks.append(
            f'<section class="cluster" id="cluster-{cluster["id"]}">'
            f'<h3>{cluster["id"]}. {escaped(cluster["title"])} <span class="muted">— {_plural(cluster["count"], "case")}, '
            f'{_plural(len(ops), "op")}</span></h3><ul>'
            f"<li>kind: <span class=\"cluster-kind\">{escaped(cluster['kind'])}</span>{escaped(also)}; hits: {escaped(cluster['where'])}; "
            f"op family: {escaped(cluster['family'])}; outcomes: {_counts(cluster.get('outcomes') or {})}</li>{shown}"
            f"<li>ops: {escaped(spans)}</li><li>dtypes: {_counts(cluster.get('dtypes') or {})}</li>{explained}"
            f"<li>smallest case{shrunk}: <code>{escaped(smallest.get('id'))}</code> ({escaped(smallest.get('op'))}, "
            f"{escaped(smallest.get('dtype'))}; {escaped(smallest.get('shape'))}) <a href=\"#cluster-{cluster['id']}-cases\">all its cases</a></li>"
            f"</ul>{repro}</section>"
        )
    total = sum(cluster["count"] for cluster in clusters)
    return (
        f'<section id="clusters"><h2>Problems: {len(clusters)} distinct, {_plural(total, "failing case")}</h2>'
        '<p class="muted">failures grouped by kind, the rows they hit, the op family (dense LoRA or MoE) and the '
        "knob values they depend on; "
        "each problem's smallest case is the one to debug first</p>" + "".join(blocks) + "</section>"
    )


def _coverage(coverage: dict, dtypes: list[str]) -> str:
    """Per op: cases that ran (and passed) per dtype (every dtype of the run, so a dtype that never ran shows
    as 0) and headline feature; below, every family and feature, folded."""
    ops = coverage.get("ops") or {}
    if not ops:
        return ""
    headline = list(coverage.get("headline") or HEADLINE)
    head = (
        "<tr><th>op</th><th>level</th><th>cases run</th><th>not supported</th>" + "".join(f"<th>{escaped(d)}</th>" for d in dtypes)
        + "".join(f'<th title="{escaped(FEATURE_DOCS.get(f, f))}">{escaped(f)}</th>' for f in headline) + "</tr>"
    )  # fmt: skip
    legend = "; ".join(f"<b>{escaped(f)}</b>: {escaped(FEATURE_DOCS.get(f, ''))}" for f in headline)
    rows, details = [], []
    for name, op in ops.items():
        cells = [_coverage_cell(op["dtypes"].get(d), f' data-dtype="{escaped(d)}"') for d in dtypes]
        cells += [_coverage_cell(op["features"].get(f), f' data-feature="{escaped(f)}"') for f in headline]
        unsupported = op.get("not_supported", 0)
        rows.append(
            f'<tr data-op="{escaped(name)}"><th>{escaped(name)}</th><td class="muted">{escaped(op["level"])}</td>{_coverage_cell(op)}'
            f'<td class="num{"" if unsupported else " zero"}">{unsupported}</td>{"".join(cells)}</tr>'
        )
        if op["cases"]:
            details.append(
                f'<details data-op="{escaped(name)}"><summary>{escaped(name)}: {len(op["families"])} {"family" if len(op["families"]) == 1 else "families"}, '
                f'{_plural(len(op["features"]), "feature")}</summary>'
                f"<div>families: {_tallies(op['families'])}</div><div>features: {_tallies(op['features'])}</div></details>"
            )
    return (
        '<section><h2>Coverage: what the cases exercised</h2>'
        f'<p class="muted">per op, {escaped(coverage.get("counted", "cases run"))}: a cell reads cases (passed). {legend}</p>'
        f'<table id="coverage">{head}{"".join(rows)}</table>'
        f'<h3>Every family and feature, per op</h3><div id="coverage-details">{"".join(details)}</div></section>'
    )


def _coverage_cell(tally: dict | None, attribute: str = "") -> str:
    """``cases (passed)``; a zero greyed: nothing of the kind ran."""
    if not tally or not tally["cases"]:
        return f'<td class="num zero"{attribute}>0</td>'
    return f'<td class="num"{attribute}>{tally["cases"]} ({tally["passed"]})</td>'


def _tallies(counts: dict) -> str:
    return ", ".join(f'<span title="{escaped(FEATURE_DOCS.get(name, ""))}">{escaped(name)} {t["cases"]} ({t["passed"]})</span>' for name, t in counts.items())


def _run(document: dict, results: list[dict]) -> str:
    counts = Counter(result["outcome"] for result in results)
    rows = [
        ("target", document.get("target_name") or document.get("target")),
        ("profile", document.get("profile")),
        ("seed", document.get("seed")),
        ("suite version", document.get("suite_version")),
        ("expectations", document.get("expectations") or "none"),
    ]
    if document.get("target_name") and document.get("target") != document["target_name"]:
        rows.insert(1, ("target as requested", document.get("target")))
    if document.get("shard"):
        rows.append(("shard", document["shard"]))
    if document.get("merged_from"):
        rows.append(("merged from", f"{len(document['merged_from'])} results files"))
    if document.get("replay"):
        rows.append(("replay", document["replay"]))
    if document.get("isolation"):
        timeout = document.get("case_timeout")
        rows.append(("isolation", f"{document['isolation']}, case timeout " + (f"{timeout:g} s" if timeout else "none")))
    if document.get("referee"):
        rows.append(("referee", f"{document['referee']}; {document.get('repeat', 1)} call(s) per case compared bit for bit"
                     + (", determinism required" if document.get("require_deterministic") else "")))
    if document.get("case_list"):
        expected = len(document.get("expected") or [])
        shard = len(document.get("shard_cases") or [])
        selection = f" (a selection: {expected} of this shard's {shard})" if expected != shard else ""
        rows.append(("cases", f"{expected} expected{selection}; the profile holds {document['case_list']['count']}"))
    rows.extend((f"skipped: {name}", why) for name, why in skipped_parts(document.get("environment") or {}))  # optional parts missing
    placements = dict.fromkeys(r["placement"]["label"] for r in results if isinstance(r.get("placement"), dict))
    if placements:  # where tensor-parallel ranks ran (conformance.tp.placement): shared devices, fallback collectives
        rows.append(("tensor-parallel ranks", "; ".join(placements)))
    body = "".join(f"<dt>{escaped(name)}</dt><dd>{escaped(value)}</dd>" for name, value in rows)
    legend = " ".join(badge(outcome, f"{counts.get(outcome, 0)} {outcome}") for outcome in OUTCOME_STYLE)
    return f'<section id="run"><h2>Run</h2><dl class="run">{body}</dl><p>{len(results)} cases: {legend}</p></section>'


def _dtypes(results: list[dict]) -> list[str]:
    seen = {result["dtype"] for result in results}
    return [d for d in DTYPE_ORDER if d in seen] + sorted(seen - set(DTYPE_ORDER))


def _matrix(results: list[dict]) -> str:
    dtypes = _dtypes(results)
    cells: dict[tuple[str, str], Counter] = defaultdict(Counter)
    levels: dict[str, set[str]] = defaultdict(set)
    for result in results:
        cells[result["op"], result["dtype"]][result["outcome"]] += 1
        levels[result.get("level") or "other"].add(result["op"])
    head = "<tr><th>op</th>" + "".join(f"<th>{escaped(d)}</th>" for d in dtypes) + "</tr>"
    rows = []
    for level in [lv for lv in LEVELS if lv in levels] + sorted(set(levels) - set(LEVELS)):
        rows.append(f'<tr class="level"><th colspan="{len(dtypes) + 1}">{escaped(level)}</th></tr>')
        for op in sorted(levels[level]):
            tds = []
            for dtype in dtypes:
                cell = cells.get((op, dtype))
                if not cell:
                    tds.append('<td class="muted">—</td>')
                    continue
                badges = " ".join(badge(o, f"{cell[o]} {o}") for o in OUTCOME_STYLE if cell.get(o))
                tds.append(f'<td data-op="{escaped(op)}" data-dtype="{escaped(dtype)}">{badges}</td>')
            rows.append(f"<tr><th>{escaped(op)}</th>{''.join(tds)}</tr>")
    if not results:
        rows.append(f'<tr><td colspan="{len(dtypes) + 1}" class="muted">no case ran</td></tr>')
    return f'<section><h2>Matrix: op × dtype</h2><table id="matrix">{head}{"".join(rows)}</table></section>'


def _number(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


# A problem with more failing cases than this shows them folded: the cluster above says what they share.
OPEN_CASES = 10


def _failures(results: list[dict], clusters: list[dict], cluster_by_case: dict[str, dict]) -> str:
    failing = [r for r in results if r["outcome"] in REJECTED]
    if not failing:
        return '<section id="failures"><h2>Failures</h2><p class="muted">none</p></section>'
    head = (
        "<tr><th>case</th><th>outcome</th><th>kind</th><th>op</th><th>dtype</th><th>max abs error</th>"
        "<th>max ULP</th><th>budget ratio</th><th>message and repro</th></tr>"
    )
    groups: dict[int | None, list[dict]] = defaultdict(list)
    for result in failing:
        cluster = cluster_by_case.get(result["id"])
        groups[cluster["id"] if cluster else None].append(result)
    blocks = []
    for cluster in [*clusters, None]:
        number = cluster["id"] if cluster else None
        members = groups.get(number)
        if not members:
            continue
        summary = (
            f"problem {number}: {escaped(cluster['title'])} — {_plural(len(members), 'case')}" if cluster
            else f"not in a problem — {_plural(len(members), 'case')}"
        )
        rows = "".join(_failure_row(result, number) for result in members)
        anchor = f' id="cluster-{number}-cases"' if number else ""
        opened = " open" if len(members) <= OPEN_CASES else ""
        blocks.append(f"<details{anchor}{opened}><summary>{summary}</summary><table>{head}{rows}</table></details>")
    return f'<section><h2>Failures ({len(failing)})</h2><div id="failures">{"".join(blocks)}</div></section>'


def _failure_row(result: dict, cluster: int | None) -> str:
    m = result.get("measurement") or {}
    repro = result.get("repro")
    detail = f"<div>{escaped(safe_text(result.get('message') or ''))}</div>"  # cut to MESSAGE_LIMIT: a message can be 10 MB
    if result.get("traceback"):  # what the target raised, formatted in its process: folded, it is long
        detail += ('<details class="traceback"><summary>traceback</summary>'
                   f'<pre class="traceback">{escaped(safe_text(result["traceback"], TRACEBACK_LIMIT))}</pre></details>')
    if repro:
        detail += f'<pre class="repro">{escaped(repro)}</pre>'
    if result.get("replay"):
        detail += f'<div class="muted">replay: <code>{escaped(result["replay"])}</code></div>'
    data = f' data-cluster="{cluster}"' if cluster else ""
    return (
        f'<tr id="case-{escaped(result["id"])}"{data}><td><code>{escaped(result["id"])}</code></td>'
        f"<td>{badge(result['outcome'], result['outcome'])}</td>"
        f"<td class=\"kind\">{escaped(', '.join(result.get('kinds') or []) or '—')}</td><td>{escaped(result['op'])}</td>"
        f"<td>{escaped(result['dtype'])}</td><td class=\"num\">{_number(m.get('max_abs_error'))}</td>"
        f"<td class=\"num\">{_number(m.get('max_ulp'))}</td>"
        f"<td class=\"num\">{_number(m.get('budget_ratio'))}</td><td>{detail}</td></tr>"
    )


def _determinism(document: dict, results: list[dict]) -> str:
    """Cases whose repeated calls differed (nondeterministic) or whose verdict did not repeat (flaky)."""
    unstable = [r for r in results if r.get("stability") in ("flaky", "nondeterministic")]
    if not unstable:
        return ""
    rows = []
    for result in sorted(unstable, key=lambda r: (r["stability"], r["id"])):
        measured = result.get("determinism") or {}
        rows.append(
            f'<tr><td><code><a href="#case-{escaped(result["id"])}">{escaped(result["id"])}</a></code></td>'
            f"<td>{escaped(result['stability'])}</td><td>{badge(result['outcome'], result['outcome'])}</td>"
            f"<td class=\"num\">{escaped(measured.get('calls', '—'))}</td>"
            f"<td class=\"num\">{escaped(measured.get('differing_elements', '—'))}</td>"
            f"<td class=\"num\">{_number(measured.get('max_abs_difference'))}</td></tr>"
        )
    return (
        f'<section id="determinism"><h2>Determinism ({len(unstable)})</h2>'
        "<p>Each case's target call is repeated on fresh copies of its inputs and compared bit for bit, and a failing "
        "case is attempted twice. <b>nondeterministic</b>: the calls differ (a pass unless determinism is required); "
        "<b>flaky</b>: the verdict did not repeat (it still fails the gate).</p>"
        "<table><tr><th>case</th><th>stability</th><th>outcome</th><th>calls</th><th>differing elements</th>"
        f"<th>largest difference</th></tr>{''.join(rows)}</table></section>"
    )


def _end_to_end(results: list[dict]) -> str:
    """Per end-to-end case, the checks every such case adds (``engine_checks``: base-request invariance, graphs vs
    eager): "checked", or why not (``conformance.e2e.referee``)."""
    model = [r for r in results if r.get("level") == "model"]
    if not model:
        return ""
    rows = []
    for result in sorted(model, key=lambda r: r["id"]):
        checks = result.get("engine_checks") or {}
        cells = "".join(f"<td>{escaped(checks.get(name, 'not run'))}</td>" for name in ("base_request_invariance", "graphs_vs_eager"))
        case = escaped(result["id"])
        if result["outcome"] in REJECTED:  # a failure's row in the failures section has its message and repro
            case = f'<a href="#case-{case}">{case}</a>'
        rows.append(f'<tr data-e2e="{escaped(result["id"])}"><td><code>{case}</code></td>'
                    f"<td>{badge(result['outcome'], result['outcome'])}</td>{cells}</tr>")
    return (
        f'<section id="end-to-end"><h2>End to end ({len(model)})</h2>'
        "<p>Every end-to-end case also checks <b>base-request invariance</b> (requests without an adapter get what the "
        "same engine with LoRA disabled gives them; a difference fails as <i>changed base requests</i>) and "
        "<b>graphs vs eager</b> (the batch generated with captured graphs gives the eager run's and the reference's "
        "tokens), or says why it could not.</p>"
        "<table><tr><th>case</th><th>outcome</th><th>base-request invariance</th><th>graphs vs eager</th></tr>"
        f"{''.join(rows)}</table></section>"
    )


def _bit_differences(results: list[dict]) -> str:
    """Cases where what had to stay as it was kept its values and changed bits (docs/verdict.md): said, not failed."""
    rows = []
    for result in sorted(results, key=lambda r: r["id"]):
        for record in (result.get("measurement") or {}).get("bit_differences") or []:
            entry = BitDifferences.from_json(record)
            rows.append(
                f'<tr><td><code>{escaped(result["id"])}</code></td><td>{badge(result["outcome"], result["outcome"])}</td>'
                f"<td>{escaped(entry.note())}</td><td>rows {escaped(_indices(entry.rows))}; columns {escaped(_indices(entry.columns))}</td></tr>"
            )
    if not rows:
        return ""
    return (
        f'<section><h2>Bit-level differences ({len(rows)})</h2><div id="bit-differences">'
        "<p>Elements that had to stay as they were (the output outside its written region, the inputs) came back with "
        "equal values and other bits: a zero whose sign flipped, a NaN with another payload. A LoRA delta is added into "
        "the base layer's output, where +0 and −0 add to the same value; no wrong number, so no failure.</p>"
        f"<table><tr><th>case</th><th>outcome</th><th>what</th><th>where</th></tr>{''.join(rows)}</table></div></section>"
    )


def _indices(values, limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", …" if len(values) > limit else "")


def _missing(document: dict) -> str:
    """Expected cases without a result: never judged, so never passed."""
    missing = document.get("missing") or []
    if not missing:
        return ""
    items = "".join(f"<li><code>{escaped(case_id)}</code></li>" for case_id in missing)
    resume = ""
    if document.get("report_dir"):
        resume = f'<pre class="repro">pytest conformance --resume {escaped(document["report_dir"])}</pre>'
    return (
        f'<section><h2>Cases without a result ({len(missing)})</h2><div id="missing">'
        "<p>These cases were to be judged and were not: the run was killed before them, a process died "
        "unrecorded, or a shard is missing. They fail the gate. <code>pytest conformance --resume REPORT_DIR</code> "
        f"runs only them and completes this report.</p>{resume}<ul>{items}</ul></div></section>"
    )


def _not_applicable(document: dict) -> str:
    entries = document.get("expectations_not_applicable") or []
    if not entries:
        return ""
    rows = "".join(
        f"<tr><td><code>{escaped(entry.get('id'))}</code></td><td>{escaped(entry.get('reason'))}</td>"
        f"<td>{escaped(entry.get('not_applicable'))}</td></tr>"
        for entry in entries
    )
    head = "<tr><th>entry</th><th>reason</th><th>why it does not apply here</th></tr>"
    return (
        '<section><h2>Known failures not applicable here</h2><p class="muted">entries of the expectations file '
        "whose package versions are not the installed ones: they match no case in this run</p>"
        f'<table id="not-applicable">{head}{rows}</table></section>'
    )


def _known_failures(gate: dict, results: list[dict]) -> str:
    entries = {entry["id"]: dict(entry) for entry in gate.get("known_failures") or []}
    for result in results:  # a document without a gate section still lists its known failures
        entry = result.get("expectation")
        if result["outcome"] == Outcome.KNOWN_FAILURE.value and entry and entry.get("id") not in entries:
            entries[entry["id"]] = {**entry, "cases": sum(
                1 for r in results if r["outcome"] == Outcome.KNOWN_FAILURE.value and (r.get("expectation") or {}).get("id") == entry["id"]
            )}
    if not entries:
        return '<section id="known-failures"><h2>Known failures</h2><p class="muted">none</p></section>'
    rows = []
    for entry in entries.values():
        links = ", ".join(f'<a href="{escaped(url)}">{escaped(url)}</a>' for url in entry.get("upstream") or [])
        rows.append(
            f"<tr><td><code>{escaped(entry.get('id'))}</code></td><td>{escaped(entry.get('reason'))}</td>"
            f"<td>{links or '—'}</td><td>{escaped(entry.get('expires'))}</td>"
            f"<td class=\"num\">{escaped(entry.get('cases'))}</td></tr>"
        )
    head = "<tr><th>entry</th><th>reason</th><th>upstream</th><th>expires</th><th>cases</th></tr>"
    return f'<section><h2>Known failures</h2><table id="known-failures">{head}{"".join(rows)}</table></section>'


def _environment(document: dict) -> str:
    """The fingerprint; for a merge of machines that differ, one column per input; then the workers."""
    fingerprints = [f for f in document.get("environments") or [] if isinstance(f.get("environment"), dict)]
    environment = document.get("environment")
    if len(fingerprints) > 1:
        keys = list(dict.fromkeys(k for f in fingerprints for k in f["environment"]))
        head = "<tr><th></th>" + "".join(
            f"<th>{escaped(f['source'])}" + (f" (shard {escaped(f['shard'])})" if f.get("shard") else "") + "</th>" for f in fingerprints
        ) + "</tr>"
        rows = []
        for key in keys:
            values = [f["environment"].get(key) for f in fingerprints]
            differs = ' class="differs"' if len({str(v) for v in values}) > 1 else ""
            rows.append(f"<tr{differs}><th>{escaped(key)}</th>" + "".join(f"<td>{escaped(v)}</td>" for v in values) + "</tr>")
        table = f'<p>{len(fingerprints)} inputs, fingerprints differ (rows marked):</p><table id="environment">{head}{"".join(rows)}</table>'
    else:
        if not isinstance(environment, dict) or not environment:
            keys = ("python", "suite_version", "target", "expectations", "shard")
            environment = {key: document[key] for key in keys if document.get(key) is not None}
        rows = "".join(f"<tr><th>{escaped(k)}</th><td>{escaped(v)}</td></tr>" for k, v in environment.items())
        table = f'<table id="environment">{rows}</table>'
    return f"<section><h2>Environment</h2>{table}{_workers(document.get('workers') or [])}</section>"


def _workers(workers: list[dict]) -> str:
    """Which process ran on which device (``--devices``), when there is more than one or one was assigned."""
    if not workers or (len(workers) == 1 and set(workers[0]) <= {"worker", "pid", "device", "driver"}):
        return ""
    columns = list(dict.fromkeys(k for w in workers for k in w if k not in ("pid", "target_output_at_load")))  # that one: its own section
    head = "".join(f"<th>{escaped(c)}</th>" for c in columns)
    rows = "".join("<tr>" + "".join(f"<td>{escaped(w.get(c, '—'))}</td>" for c in columns) + "</tr>" for w in workers)
    return f'<h3>Workers</h3><table id="workers"><tr>{head}</tr>{rows}</table>'


# The plot: one row per op, log10(budget ratio) on x from LOG_MIN to LOG_MAX (clamped, beyond-range
# points sit on the edge), a box from the quartiles with the median, and every case as a dot coloured
# by its outcome. The dashed line at 0 is the budget: dots right of it are outside.
LOG_MIN, LOG_MAX = -4.0, 2.0


def _quantile(values: list[float], q: float) -> float:
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def _budget_plot(results: list[dict]) -> str:
    per_op: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for result in results:
        ratio = number_from_json((result.get("measurement") or {}).get("budget_ratio"))
        if ratio is None:
            continue
        x = LOG_MAX if ratio == math.inf else (LOG_MIN if ratio <= 0 else math.log10(ratio))
        per_op[result["op"]].append((min(max(x, LOG_MIN), LOG_MAX), result["outcome"]))
    if not per_op:
        return '<section><h2>Budget ratios</h2><p class="muted" id="budget-ratios">no measurements</p></section>'
    left, width, row_h, top = 170, 640, 26, 20
    height = top + row_h * len(per_op) + 34

    def sx(x: float) -> float:
        return left + (x - LOG_MIN) / (LOG_MAX - LOG_MIN) * width

    parts = [
        f'<svg id="budget-ratios" xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
        f'height="{height}" font-family="sans-serif" font-size="11">'
    ]
    for tick in range(int(LOG_MIN), int(LOG_MAX) + 1):
        x = sx(tick)
        dash = ' stroke-dasharray="4 3" stroke="#c62828"' if tick == 0 else ' stroke="#e0e0e0"'
        parts.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 28}"{dash}/>')
        parts.append(f'<text x="{x:.1f}" y="{height - 14}" text-anchor="middle">1e{tick}</text>')
    parts.append(
        f'<text x="{left + width / 2:.0f}" y="{height - 1}" text-anchor="middle">'
        "budget ratio (error ÷ budget, log scale; right of the dashed line = outside the budget)</text>"
    )
    for row, op in enumerate(sorted(per_op)):
        points = per_op[op]
        y = top + row * row_h + row_h / 2
        values = sorted(x for x, _ in points)
        q1, q2, q3 = (_quantile(values, q) for q in (0.25, 0.5, 0.75))
        parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{escaped(op)} ({len(points)})</text>')
        parts.append(
            f'<rect x="{sx(q1):.1f}" y="{y - 8:.1f}" width="{max(sx(q3) - sx(q1), 1):.1f}" height="16" '
            'fill="#bbdefb" stroke="#1565c0"/>'
        )
        parts.append(f'<line x1="{sx(q2):.1f}" y1="{y - 8:.1f}" x2="{sx(q2):.1f}" y2="{y + 8:.1f}" stroke="#0d47a1" stroke-width="2"/>')
        for index, (x, outcome) in enumerate(points):
            colour = OUTCOME_STYLE.get(outcome, ("", "#000"))[1]
            jitter = ((index * 7919) % 11 - 5) * 0.9
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{y + jitter:.1f}" r="2.2" fill="{colour}" fill-opacity="0.75"/>')
    parts.append("</svg>")
    return "<section><h2>Budget ratios per op</h2>" + "".join(parts) + "</section>"
