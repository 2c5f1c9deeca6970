"""``compare.html``: a comparison of runs (``conformance.report.compare``) as one self-contained page.

Like report.html it has inline CSS and an inline SVG plot, no script, and loads nothing. Sections: the
summary, the runs, the level × op × dtype table (each run's outcomes and budget-ratio quartiles, which
run is closer to the reference where all pass), the budget ratios of every run overlaid on one axis,
the cases whose outcomes differ, the cases some run does not support, and the end-to-end tokens.

Elements a test (or a scraper) can query: ``id="summary"``, ``id="runs"``, ``id="cells"`` (a row per
level × op × dtype, ``data-op``/``data-dtype``; ``class="closer"`` cells), ``id="ratio-plot"`` (an
SVG, a ``class="series"`` group per run and row with ``data-run``/``data-op``/``data-dtype``),
``id="differing"`` (a row per case, ``data-case``, with ``class="repro"`` on the repro commands),
``id="unsupported"``, ``id="e2e-tokens"`` (a row per end-to-end case, ``data-agree`` yes/no/unknown).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from conformance.report.compare import MISSING, OUTCOMES, quantiles
from conformance.report.html import CSS, DTYPE_ORDER, LEVELS, LOG_MAX, LOG_MIN, OUTCOME_STYLE, badge, escaped

BADGE_STYLE = {**OUTCOME_STYLE, MISSING: ("missing", "#212121")}
RUN_COLOURS = ("#1565c0", "#ef6c00", "#00838f", "#6a1b9a", "#558b2f", "#ad1457")  # one per run, in input order
COMPARE_CSS = CSS + """
.missing{background:#212121}
pre.message{white-space:pre-wrap;word-break:break-word;margin:.2em 0;font-size:.86em;max-height:14em;overflow:auto}
td.agree-yes{color:#2e7d32;font-weight:600}td.agree-no{color:#c62828;font-weight:600}
td.closer{font-weight:600}.swatch{display:inline-block;width:.9em;height:.9em;border-radius:2px;vertical-align:middle}
details summary{cursor:pointer}
"""


def write_compare_html(comparison: dict, path) -> Path:
    """Render ``comparison`` (the content of ``compare.json``) to ``path``; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_compare_html(comparison), encoding="utf-8")
    return path


def render_compare_html(comparison: dict) -> str:
    labels = [run["label"] for run in comparison["runs"]]
    colours = {label: RUN_COLOURS[i % len(RUN_COLOURS)] for i, label in enumerate(labels)}
    title = " vs ".join(labels)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>LoRA conformance comparison: {escaped(title)}</title>",
        f"<style>{COMPARE_CSS}</style></head><body>",
        f"<h1>LoRA conformance comparison: {escaped(title)}</h1>",
        _summary(comparison, labels),
        _runs(comparison["runs"], colours),
        _cells(comparison["cells"], labels),
        _ratio_plot(comparison["cells"], comparison, labels, colours),
        _differing(comparison["differing"], labels),
        _unsupported(comparison["unsupported"], labels),
        _e2e_tokens(comparison["e2e"], labels),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _badges(counts: dict) -> str:
    return " ".join(badge(o, f"{counts[o]} {o}", BADGE_STYLE) for o in OUTCOMES if counts.get(o)) or '<span class="muted">—</span>'


def _number(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _swatch(colour: str) -> str:
    return f'<span class="swatch" style="background:{colour}"></span>'


def _summary(comparison: dict, labels: list[str]) -> str:
    summary = comparison["summary"]
    e2e = comparison["e2e"]
    agreeing = sum(1 for entry in e2e if entry["agree"])
    judged = sum(1 for entry in e2e if entry["agree"] is not None)
    closer = "; ".join(f"{label} on {n}" for label, n in summary["closer"].items())
    items = [
        f"profile {escaped(comparison['profile'])}, seed {escaped(comparison['seed'])}, {comparison['cases']} cases in every run",
        f'<a href="#differing">{summary["differing"]} case(s)</a> whose outcomes differ among the runs that support them',
        f'<a href="#unsupported">{summary["unsupported_by_some"]} case(s)</a> some run does not support'
        + (f" ({summary['unsupported_by_all']} no run supports)" if summary["unsupported_by_all"] else ""),
        f"closer to the reference where all pass, op × dtype cells: {escaped(closer)}; as close on {summary['as_close']}",
        f'<a href="#e2e-tokens">end-to-end tokens</a>: the same in {agreeing} of {judged} case(s) every run generated'
        + (f" ({len(e2e) - judged} without tokens in some run)" if len(e2e) > judged else ""),
    ]
    return '<section id="summary"><ul>' + "".join(f"<li>{item}</li>" for item in items) + "</ul></section>"


def _runs(runs: list[dict], colours: dict[str, str]) -> str:
    head = ("<tr><th>run</th><th>source</th><th>target</th><th>expectations</th><th>gate</th><th>outcomes</th>"
            "<th>determinism</th><th>environment</th></tr>")
    rows = []
    for run in runs:
        gate = {True: "PASS", False: "FAIL"}.get(run["gate_passed"], "—")
        counts = {**run["counts"], **({MISSING: run["missing"]} if run["missing"] else {})}
        environment = ", ".join(
            f"{key} {str(value)[:12] if key == 'git_commit' else value}" for key, value in run["environment"].items()
        )
        rows.append(
            f'<tr data-run="{escaped(run["label"])}"><th>{_swatch(colours[run["label"]])} {escaped(run["label"])}</th>'
            f"<td><code>{escaped(run['source'])}</code></td><td>{escaped(run['target'])}</td><td>{escaped(run['expectations'] or 'none')}</td>"
            f'<td>{gate}</td><td>{_badges(counts)}</td><td>{_stability(run.get("stability") or {})}</td>'
            f'<td class="muted">{escaped(environment)}</td></tr>'
        )
    return f'<section><h2>Runs</h2><table id="runs">{head}{"".join(rows)}</table></section>'


def _stability(stability: dict) -> str:
    """"2 nondeterministic, 1 flaky" with the ids in a tooltip; "—" when every case repeated itself."""
    parts = [f'<span title="{escaped(", ".join(ids[:50]))}">{len(ids)} {escaped(label)}</span>'
             for label, ids in stability.items() if ids]
    return ", ".join(parts) or "—"


def _rank(entry: dict) -> tuple:
    """Level (the design's order, others after), op, dtype (float32, float16, bfloat16, others), case id."""
    level, dtype = entry["level"], entry["dtype"]
    level_rank = (LEVELS.index(level), "") if level in LEVELS else (len(LEVELS), level)
    dtype_rank = (DTYPE_ORDER.index(dtype), "") if dtype in DTYPE_ORDER else (len(DTYPE_ORDER), dtype)
    return level_rank, entry["op"], dtype_rank, entry.get("id", "")


def _ordered(cells: list[dict]) -> list[tuple[str, list[dict]]]:
    """Cells grouped by level, in :func:`_rank` order."""
    ordered = sorted(cells, key=_rank)
    levels = list(dict.fromkeys(cell["level"] for cell in ordered))
    return [(level, [c for c in ordered if c["level"] == level]) for level in levels]


def _closer(closer: dict | None) -> str:
    if closer is None:
        return '<td class="muted">— (measured against itself)</td>'
    if not closer["cases"]:
        return '<td class="muted">— (no case every run passes)</td>'
    wins = " vs ".join(str(n) for n in closer["closest_on"].values())
    medians = " vs ".join(_number(value) for value in closer["median"]["budget_ratio"].values())
    detail = f"closest on {wins} of {closer['cases']} ({closer['ties']} tied); median ratio {medians}"
    if closer["closer"] is None:
        return f'<td class="closer" data-closer="">as close<div class="muted">{escaped(detail)}</div></td>'
    return f'<td class="closer" data-closer="{escaped(closer["closer"])}">{escaped(closer["closer"])}<div class="muted">{escaped(detail)}</div></td>'


def _cells(cells: list[dict], labels: list[str]) -> str:
    head = (
        "<tr><th>op</th><th>dtype</th><th>cases</th>"
        + "".join(f"<th>{escaped(label)}</th>" for label in labels)
        + f"<th>closer to the reference where all pass ({escaped(' vs '.join(labels))})</th></tr>"
    )
    rows = []
    for level, members in _ordered(cells):
        rows.append(f'<tr class="level"><th colspan="{4 + len(labels)}">{escaped(level)}</th></tr>')
        for cell in members:
            tds = []
            for label in labels:
                run = cell["runs"][label]
                ratio = run["budget_ratio"]
                spread = (
                    f'<div class="ratio muted">ratio {_number(ratio["median"])} [{_number(ratio["q25"])}–{_number(ratio["q75"])}], '
                    f'max {_number(ratio["max"])}</div>'
                    if ratio else ""
                )
                tds.append(f'<td data-run="{escaped(label)}">{_badges(run["counts"])}{spread}</td>')
            rows.append(
                f'<tr data-op="{escaped(cell["op"])}" data-dtype="{escaped(cell["dtype"])}"><th>{escaped(cell["op"])}</th><td>{escaped(cell["dtype"])}</td>'
                f'<td class="num">{cell["cases"]}</td>{"".join(tds)}{_closer(cell["closer"])}</tr>'
            )
    return (
        '<section><h2>Level × op × dtype</h2><p class="muted">each run\'s outcomes and budget ratios: median '
        "[quartiles], max; where every run passes a case, the run with the smaller ratio is closer on it</p>"
        f'<table id="cells">{head}{"".join(rows)}</table></section>'
    )


# The plot: report.html's axis (log10 of the budget ratio from LOG_MIN to LOG_MAX, clamped, the dashed
# budget line at 0), one row per op × dtype, and in each row a lane per run in its colour: the box from
# its quartiles, the median, every case as a dot. Lanes share the axis, so the runs read against each other.
LEFT, WIDTH, LANE_H, ROW_GAP, TOP = 230, 620, 11, 8, 34


def _ratio_plot(cells: list[dict], comparison: dict, labels: list[str], colours: dict[str, str]) -> str:
    points = _points(comparison, labels)
    rows = [(level, cell) for level, members in _ordered(cells) for cell in members
            if any(points.get((cell["op"], cell["dtype"], label)) for label in labels)]  # fmt: skip
    if not rows:
        return '<section><h2>Budget ratios, overlaid</h2><p class="muted" id="ratio-plot">no measurements</p></section>'
    row_h = LANE_H * len(labels) + ROW_GAP
    height = TOP + row_h * len(rows) + 34

    def sx(x: float) -> float:
        return LEFT + (x - LOG_MIN) / (LOG_MAX - LOG_MIN) * WIDTH

    parts = [
        f'<svg id="ratio-plot" xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        '<g id="legend">'
        + "".join(
            f'<rect x="{LEFT + i * 150}" y="4" width="12" height="12" fill="{colours[label]}"/>'
            f'<text x="{LEFT + i * 150 + 16}" y="14">{escaped(label)}</text>'
            for i, label in enumerate(labels)
        )
        + "</g>",
    ]
    for tick in range(int(LOG_MIN), int(LOG_MAX) + 1):
        x = sx(tick)
        dash = ' stroke-dasharray="4 3" stroke="#c62828"' if tick == 0 else ' stroke="#e0e0e0"'
        parts.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height - 28}"{dash}/>')
        parts.append(f'<text x="{x:.1f}" y="{height - 14}" text-anchor="middle">1e{tick}</text>')
    parts.append(
        f'<text x="{LEFT + WIDTH / 2:.0f}" y="{height - 1}" text-anchor="middle">'
        "budget ratio (error ÷ budget, log scale; right of the dashed line = outside the budget)</text>"
    )
    for row, (level, cell) in enumerate(rows):
        top = TOP + row * row_h
        parts.append(
            f'<text x="{LEFT - 8}" y="{top + row_h / 2 + 1:.1f}" text-anchor="end">'
            f'{escaped(cell["op"])} · {escaped(cell["dtype"])}</text>'
        )
        for lane, label in enumerate(labels):
            xs = points.get((cell["op"], cell["dtype"], label)) or []
            if not xs:
                continue
            y = top + lane * LANE_H + LANE_H / 2
            spread = quantiles(xs)
            q1, q2, q3 = spread["q25"], spread["median"], spread["q75"]
            colour = colours[label]
            series = [
                f'<g class="series" data-run="{escaped(label)}" data-op="{escaped(cell["op"])}" data-dtype="{escaped(cell["dtype"])}" '
                f'data-level="{escaped(level)}" data-cases="{len(xs)}">',
                f'<rect x="{sx(q1):.1f}" y="{y - 4:.1f}" width="{max(sx(q3) - sx(q1), 1):.1f}" height="8" fill="{colour}" '
                f'fill-opacity="0.25" stroke="{colour}"/>',
                f'<line x1="{sx(q2):.1f}" y1="{y - 5:.1f}" x2="{sx(q2):.1f}" y2="{y + 5:.1f}" stroke="{colour}" stroke-width="2"/>',
            ]
            for index, x in enumerate(xs):
                jitter = ((index * 7919) % 7 - 3) * 0.9
                series.append(f'<circle cx="{sx(x):.1f}" cy="{y + jitter:.1f}" r="1.8" fill="{colour}" fill-opacity="0.7"/>')
            parts.append("".join(series) + "</g>")
    parts.append("</svg>")
    return "<section><h2>Budget ratios, overlaid</h2>" + "".join(parts) + "</section>"


def _points(comparison: dict, labels: list[str]) -> dict[tuple[str, str, str], list[float]]:
    """Each run's budget ratios per op × dtype (every case's, ``ratios`` in compare.json), as clamped
    log10 values on the plot's axis."""
    found: dict[tuple[str, str, str], list[float]] = {}
    for cell in comparison["cells"]:
        for label in labels:
            ratios = cell["runs"][label].get("ratios") or []
            found[cell["op"], cell["dtype"], label] = [_log(r) for r in ratios]
    return found


def _log(ratio: float) -> float:
    x = LOG_MAX if ratio == math.inf else (LOG_MIN if ratio <= 0 else math.log10(ratio))
    return min(max(x, LOG_MIN), LOG_MAX)


def _run_result(run: dict) -> str:
    parts = [badge(run["outcome"], run["outcome"], BADGE_STYLE)]
    if run.get("kind"):
        parts.append(f' <span class="kind">{escaped(run["kind"])}</span>')
    if run.get("budget_ratio") is not None:
        parts.append(f' <span class="muted">ratio {_number(run["budget_ratio"])}</span>')
    if run.get("message"):
        parts.append(f'<pre class="message">{escaped(run["message"])}</pre>')
    if run.get("repro"):
        parts.append(f'<pre class="repro">{escaped(run["repro"])}</pre>')
    return "".join(parts)


def _differing(differing: list[dict], labels: list[str]) -> str:
    if not differing:
        return '<section><h2>Cases whose outcomes differ</h2><p class="muted" id="differing">none</p></section>'
    head = "<tr><th>case</th><th>op</th><th>dtype</th>" + "".join(f"<th>{escaped(label)}</th>" for label in labels) + "</tr>"
    rows = [
        f'<tr data-case="{escaped(case["id"])}" id="case-{escaped(case["id"])}"><td><code>{escaped(case["id"])}</code></td>'
        f"<td>{escaped(case['op'])}</td><td>{escaped(case['dtype'])}</td>"
        + "".join(f'<td data-run="{escaped(label)}">{_run_result(case["runs"][label])}</td>' for label in labels)
        + "</tr>"
        for case in sorted(differing, key=_rank)
    ]
    return (
        f"<section><h2>Cases whose outcomes differ ({len(differing)})</h2>"
        '<p class="muted">among the runs that support each case; a case some run does not support is listed below</p>'
        f'<table id="differing">{head}{"".join(rows)}</table></section>'
    )


def _unsupported(unsupported: list[dict], labels: list[str]) -> str:
    """Grouped by op, dtype, which runs do not support it and why: the same reason covers many cases."""
    if not unsupported:
        return '<section><h2>Cases some run does not support</h2><p class="muted" id="unsupported">none</p></section>'
    groups: dict[tuple, list[dict]] = {}
    for case in sorted(unsupported, key=_rank):
        reasons = tuple(case["runs"][label]["message"] for label in case["not_supported_by"])
        groups.setdefault((case["level"], case["op"], case["dtype"], tuple(case["not_supported_by"]), reasons), []).append(case)
    head = "<tr><th>op</th><th>dtype</th><th>not supported by</th><th>why</th><th>the other runs</th><th>cases</th></tr>"
    rows = []
    for (_, op, dtype, by, reasons), cases in groups.items():
        others = [label for label in labels if label not in by]
        outcomes = "<br>".join(
            f"{escaped(label)}: " + _badges(Counter(case["runs"][label]["outcome"] for case in cases)) for label in others
        )
        why = "<br>".join(f"{escaped(label)}: {escaped(reason)}" for label, reason in zip(by, reasons))
        ids = "<br>".join(f"<code>{escaped(case['id'])}</code>" for case in cases)
        rows.append(
            f'<tr data-op="{escaped(op)}" data-dtype="{escaped(dtype)}"><td>{escaped(op)}</td><td>{escaped(dtype)}</td><td>{escaped(", ".join(by))}</td>'
            f'<td>{why}</td><td>{outcomes}</td><td><details><summary>{len(cases)}</summary>{ids}</details></td></tr>'
        )
    return (
        f"<section><h2>Cases some run does not support ({len(unsupported)})</h2>"
        f'<table id="unsupported">{head}{"".join(rows)}</table></section>'
    )


def _e2e_tokens(entries: list[dict], labels: list[str]) -> str:
    if not entries:
        return '<section><h2>End-to-end tokens</h2><p class="muted" id="e2e-tokens">no end-to-end case</p></section>'
    head = (
        "<tr><th>case</th><th>tokens</th><th>the same?</th><th>first difference</th>"
        + "".join(f"<th>{escaped(label)}</th>" for label in labels)
        + "</tr>"
    )
    rows = []
    for entry in sorted(entries, key=lambda e: _rank({**e, "level": "model"})):
        agree = {True: "yes", False: "no", None: "unknown"}[entry["agree"]]
        if entry["agree"] is None:
            where = escaped(entry.get("why"))
        elif entry["first_difference"] is None:
            where = '<span class="muted">—</span>'
        else:
            d = entry["first_difference"]
            request = f"request {d['request']}" + (f" ({d.get('adapter') or 'base'} · {d.get('prompt')!r})" if "prompt" in d else "")
            tokens = ", ".join(f"{label} {escaped(token)}" for label, token in d["tokens"].items())
            where = f"{escaped(request)}, position {d['position']}: {tokens}; {d['requests_differing']} of {d['requests']} requests differ"
        runs = []
        for label in labels:
            run = entry["runs"][label]
            if run["matches_reference"] is None:
                against = ""
            elif run["matches_reference"]:
                against = '<div class="muted">the reference\'s tokens</div>'
            else:
                ref = run["reference_difference"]
                against = f'<div class="muted">differs from the reference at request {ref["request"]}, position {ref["position"]}</div>'
            runs.append(f'<td data-run="{escaped(label)}">{badge(run["outcome"], run["outcome"], BADGE_STYLE)}{against}</td>')
        rows.append(
            f'<tr data-case="{escaped(entry["id"])}" data-agree="{agree}"><td><code>{escaped(entry["id"])}</code></td>'
            f"<td>{escaped(entry.get('source') or '—')}</td><td class=\"agree-{agree}\">{agree}</td><td>{where}</td>{''.join(runs)}</tr>"
        )
    note = (
        '<p class="muted">greedy: the tokens generated free-running (the invariance checks: the whole batch in its order); '
        "top-1: each position's most likely token, teacher-forced on the reference's continuation. Tokens may differ "
        "after a near-tie and still pass.</p>"
    )
    return f'<section><h2>End-to-end tokens</h2>{note}<table id="e2e-tokens">{head}{"".join(rows)}</table></section>'


