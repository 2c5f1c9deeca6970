"""What the target said during the run (its Python warnings, its lines on stdout and stderr), deduplicated
over the run: the report's section, results.json's ``target_output`` and the terminal's one line.

Each case's record keeps what its worker collected while it ran (``conformance.isolation.output``: the most
frequent warnings and lines with their counts), and each worker's entry what the target said while it was
imported and made (``target_output_at_load``). Here they become one list per kind: each distinct warning
(category, message, where) and line with how often it came, in how many cases, and the first case that
raised it, so a flood of the same deprecation in 1,000 cases is one row, and the terminal, where the
verdict is read, says only how much there was and where to read it.
"""

from __future__ import annotations

from html import escape

from conformance.text import safe_text

RUN_KEPT = 100  # distinct warnings, and distinct lines, the run's summary keeps (the most frequent)
LOADING = "(loading the target)"
FIELDS = {"warnings": ("category", "message", "where"), "lines": ("text",)}  # what tells one from another


def _count(value, default: int = 0) -> int:
    """A count as recorded, or ``default`` for what is not one (a hand-edited or truncated results.json is read too)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _sources(document: dict):
    """(where it was said: a case id or LOADING, that place's ``target_output``) for every record and worker."""
    for record in document.get("results") or []:
        if isinstance(record, dict) and isinstance(record.get("target_output"), dict):
            yield safe_text(record.get("id", "?"), 300), record["target_output"]
    for worker in document.get("workers") or []:
        if isinstance(worker, dict) and isinstance(worker.get("target_output_at_load"), dict):
            yield f"{LOADING} {safe_text(worker.get('worker', ''), 100)}".strip(), worker["target_output_at_load"]


def summarize(document: dict) -> dict:
    """``{"warnings": [{category, message, where, count, cases, first_case}], "lines": [{text, count, cases,
    first_case}], "total": {"warnings", "lines", "cases"}, "omitted": {"warnings", "lines", "bytes"}}``; ``omitted``
    counts the distinct ones the cases or this summary left out, and the bytes of output no one read."""
    kinds = {"warnings": {}, "lines": {}}
    total = {"warnings": 0, "lines": 0, "cases": 0}
    omitted = {"warnings": 0, "lines": 0, "bytes": 0}
    for source, output in _sources(document):
        said = False
        recorded_total, recorded_omitted = (output.get(name) if isinstance(output.get(name), dict) else {} for name in ("total", "omitted"))
        for kind, fields in FIELDS.items():
            entries = output.get(kind) if isinstance(output.get(kind), list) else []
            for entry in (e for e in entries if isinstance(e, dict)):
                key = tuple(safe_text(entry.get(field), 500) for field in fields)
                row = kinds[kind].setdefault(key, {"count": 0, "cases": 0, "first_case": source})
                row["count"] += _count(entry.get("count"), 1)
                row["cases"] += 1
                said = True
            total[kind] += _count(recorded_total.get(kind))
            omitted[kind] += _count(recorded_omitted.get(kind))
        omitted["bytes"] += _count(recorded_omitted.get("bytes"))
        total["cases"] += said and not source.startswith(LOADING)
    summary = {"total": total, "omitted": omitted}
    for kind, fields in FIELDS.items():
        rows = sorted(kinds[kind].items(), key=lambda item: -item[1]["count"])
        omitted[kind] += max(0, len(rows) - RUN_KEPT)
        summary[kind] = [{**dict(zip(fields, key)), **row} for key, row in rows[:RUN_KEPT]]
    return summary


def add_target_output(document: dict) -> dict:
    """``document`` with its ``target_output`` summary (:func:`summarize`)."""
    document["target_output"] = summarize(document)
    return document


def terminal_line(document: dict, report_dir) -> str | None:
    """The one line the terminal shows of it (None when the target said nothing): how much, and where to read it."""
    summary = document.get("target_output") or summarize(document)
    total = summary["total"]
    if not (total["warnings"] or total["lines"]):
        return None
    where = f"in {total['cases']} case(s)" if total["cases"] else "while it loaded"
    return (f"target output: {total['warnings']} warning(s) ({len(summary['warnings'])} distinct) and {total['lines']} line(s) "
            f"on stdout/stderr ({len(summary['lines'])} distinct) {where}, not shown here: {report_dir}/report.html#target-output, "
            "results.json target_output")


def html_section(document: dict) -> str:
    """The report's section: one table of warnings, one of output lines, most frequent first."""
    summary = document.get("target_output") or summarize(document)
    total = summary["total"]

    def text(value) -> str:
        return escape(safe_text(value))

    if not (total["warnings"] or total["lines"]):
        return '<section id="target-output"><h2>Target output</h2><p class="muted">the target warned and printed nothing</p></section>'
    head = (f'<p class="muted">what the target\'s process warned (Python warnings) and printed (stdout, stderr) while it ran: '
            f"{total['warnings']} warning(s) and {total['lines']} line(s) in {total['cases']} case(s), each distinct one once "
            "with how often it came and the first case that raised it (every case's own in results.json)</p>")
    parts = [f'<section id="target-output"><h2>Target output</h2>{head}']
    if summary["warnings"]:
        rows = "".join(f"<tr><td>{text(w['category'])}</td><td>{text(w['message'])}</td><td>{text(w['where'])}</td>"
                       f"<td>{w['count']}</td><td>{w['cases']}</td><td>{text(w['first_case'])}</td></tr>" for w in summary["warnings"])
        parts.append('<h3>Warnings</h3><table id="target-warnings"><tr><th>category</th><th>message</th><th>where</th>'
                     f"<th>times</th><th>cases</th><th>first case</th></tr>{rows}</table>")
    if summary["lines"]:
        rows = "".join(f"<tr><td><code>{text(line['text'])}</code></td><td>{line['count']}</td><td>{line['cases']}</td>"
                       f"<td>{text(line['first_case'])}</td></tr>" for line in summary["lines"])
        parts.append('<h3>Lines on stdout and stderr</h3><table id="target-lines"><tr><th>line</th><th>times</th><th>cases</th>'
                     f"<th>first case</th></tr>{rows}</table>")
    omitted = summary["omitted"]
    if any(omitted.values()):
        parts.append(f'<p class="muted">left out: {omitted["warnings"]} distinct warning(s), {omitted["lines"]} distinct line(s), '
                     f"{omitted['bytes']} byte(s) of output not read</p>")
    return "".join(parts) + "</section>"
