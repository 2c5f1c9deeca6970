"""The one-page certificate (``certificate.html``) a person reads: what was certified and the verdict.

Rendered from the bundle's own data alone (``bundle.json``, ``results.json``, ``waivers.json``), with
no clock and nothing of the machine that renders it, so ``verify`` renders it again and requires the
same bytes: a certificate that says more or other than its bundle is caught. Sections: the verdict (and,
when it is not conformant, why), the target, device and list, the counts per outcome, the known failures
with the waivers that cover them, the cases not supported per op, the inputs (runs or shards) and the
environment fingerprint. Inline CSS, no script, loads nothing (``id`` on each section for a scraper).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from conformance.report.html import OUTCOME_STYLE, badge, escaped
from conformance.verdict import Outcome

VERDICT_STYLE = {"conformant": "#2e7d32", "not conformant": "#c62828", "invalid": "#4a148c"}
SHOWN_FINDINGS = 30
CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:1.5em auto;max-width:900px;color:#212121;padding:0 1em}"
    "h1{margin:0 0 .3em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.4em;font-size:1.2em}"
    "#verdict{padding:1em 1.4em;border-radius:8px;color:#fff}#verdict .word{font-size:2.4em;font-weight:800;letter-spacing:.04em}"
    "table{border-collapse:collapse;margin:.4em 0;font-size:.92em}th,td{border:1px solid #ddd;padding:.3em .55em;text-align:left;vertical-align:top}"
    "th{background:#f5f5f5}.num{text-align:right}.muted{color:#757575}code{word-break:break-all}"
    ".badge{display:inline-block;color:#fff;border-radius:3px;padding:0 .4em;margin:1px;font-size:.9em;white-space:nowrap}"
    + "".join(f".{cls}{{background:{colour}}}" for cls, colour in OUTCOME_STYLE.values())
)


def render_certificate(header: dict, document: dict, waivers: dict) -> str:
    """The certificate of a bundle whose ``bundle.json`` is ``header`` (its ``verdict`` filled in)."""
    verdict = header.get("verdict") or {}
    word = str(verdict.get("verdict", "not verified"))
    results = document.get("results") or []
    listed = header.get("caselist") or {}
    environment = document.get("environment") or {}
    title = f"LoRA conformance certificate: {header.get('target')} on {listed.get('name')} — {word.upper()}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escaped(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>LoRA conformance certificate</h1>",
        _verdict(word, verdict, header),
        _subject(header, environment, len(results)),
        _counts(results),
        _known_failures(waivers.get("used") or []),
        _not_supported(results),
        _inputs(header),
        _environment(environment),
        '<p class="muted">This page is rendered from the bundle\'s data; <code>lora-conformance verify BUNDLE</code> checks it '
        "and everything it says. The bundle is tamper-evident, not signed (docs/certification.md).</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _verdict(word: str, verdict: dict, header: dict) -> str:
    findings = verdict.get("findings") or []
    shown = "".join(f"<li>{escaped(line)}</li>" for line in findings[:SHOWN_FINDINGS])
    more = f"<li>… and {len(findings) - SHOWN_FINDINGS} more (lora-conformance verify lists them all)</li>" if len(findings) > SHOWN_FINDINGS else ""
    reasons = f"<ul>{shown}{more}</ul>" if findings else ""
    colour = VERDICT_STYLE.get(word, "#616161")
    return (f'<section id="verdict" style="background:{colour}"><div class="word">{escaped(word.upper())}</div>'
            f"<div>target {escaped(header.get('target'))}, case list {escaped((header.get('caselist') or {}).get('name'))}, "
            f"certified {escaped(header.get('created'))} with suite {escaped(header.get('certified_with'))}</div>{reasons}</section>")


def _rows(rows) -> str:
    return "".join(f"<tr><th>{escaped(name)}</th><td>{escaped(value)}</td></tr>" for name, value in rows)


def _subject(header: dict, environment: dict, count: int) -> str:
    listed = header.get("caselist") or {}
    rows = [
        ("target", header.get("target")),
        ("target class", header.get("target_class")),
        ("device", environment.get("device")),
        ("driver", environment.get("driver")),
        ("case list", f"{listed.get('name')} ({listed.get('count')} cases)"),
        ("case list digest", listed.get("digest")),
        ("results", f"{count} records"),
        ("suite version", header.get("suite_version")),
    ]
    return f'<section id="subject"><h2>What was certified</h2><table>{_rows(rows)}</table></section>'


def _counts(results: list[dict]) -> str:
    counts = Counter(str(record.get("outcome")) for record in results)
    badges = " ".join(badge(outcome, f"{counts.get(outcome, 0)} {outcome}") for outcome in OUTCOME_STYLE)
    return f'<section id="counts"><h2>Outcomes</h2><p>{badges}</p></section>'


def _known_failures(used: list[dict]) -> str:
    if not used:
        return '<section id="known-failures"><h2>Known failures and their waivers</h2><p class="muted">none</p></section>'
    rows = []
    for item in used:
        entry = item.get("entry") or {}
        cases = item.get(Outcome.KNOWN_FAILURE.value) or []
        unexpected = item.get(Outcome.UNEXPECTED_PASS.value) or []
        rows.append(
            f"<tr><td><code>{escaped(entry.get('id'))}</code></td><td>{escaped(entry.get('source'))}<br>"
            f"<span class=\"muted\">{escaped(entry.get('file'))}</span></td><td>{escaped(entry.get('reason'))}</td>"
            f"<td>{escaped(entry.get('approver'))}</td><td>{escaped(entry.get('expires'))}</td>"
            f"<td>{escaped(entry.get('link'))}</td><td class=\"num\">{len(cases)}"
            + (f" (+{len(unexpected)} unexpected pass)" if unexpected else "") + "</td></tr>"
        )
    head = "<tr><th>waiver</th><th>source</th><th>reason</th><th>approver</th><th>expires</th><th>link</th><th>cases</th></tr>"
    return f'<section id="known-failures"><h2>Known failures and their waivers</h2><table>{head}{"".join(rows)}</table></section>'


def _not_supported(results: list[dict]) -> str:
    per_op: dict[str, Counter] = defaultdict(Counter)
    for record in results:
        per_op[str(record.get("op"))][str(record.get("outcome") == Outcome.NOT_SUPPORTED.value)] += 1
    rows = [(op, counts["True"], counts["True"] + counts["False"]) for op, counts in sorted(per_op.items()) if counts["True"]]
    if not rows:
        return '<section id="not-supported"><h2>Not supported</h2><p class="muted">every case ran</p></section>'
    body = "".join(f'<tr><th>{escaped(op)}</th><td class="num">{n}</td><td class="num">{total}</td></tr>' for op, n, total in rows)
    return ('<section id="not-supported"><h2>Not supported</h2><table><tr><th>op</th><th>not supported</th><th>cases</th></tr>'
            f"{body}</table></section>")


def _inputs(header: dict) -> str:
    rows = "".join(
        f"<tr><td class=\"num\">{escaped(item.get('input'))}</td><td>{escaped(item.get('shard') or 'whole list')}</td>"
        f"<td class=\"num\">{escaped(item.get('cases'))}</td><td><code>{escaped(item.get('source'))}</code></td></tr>"
        for item in header.get("inputs") or []
    )
    return ('<section id="inputs"><h2>Runs</h2><table><tr><th>input</th><th>shard</th><th>cases</th><th>report dir</th></tr>'
            f"{rows}</table></section>")


def _environment(environment: dict) -> str:
    return f'<section id="environment"><h2>Environment</h2><table>{_rows(sorted(environment.items()))}</table></section>'
