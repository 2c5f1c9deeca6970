"""What the target's process says besides its answers: Python warnings and lines on its stdout or stderr.

A framework can warn on every kernel launch (a deprecated API, an autotuning cache it cannot find): a
port's smoke run printed so many such lines that the verdict scrolled away. So what the target says is
collected per case, for the report (``results.json``, each record's ``target_output``; ``report.html``,
deduplicated over the run by ``conformance.report.target_output``), and the terminal says only how much
there was and where to read it.

* **Python warnings** are recorded around each target half (:func:`collecting_warnings`, in the worker's
  :class:`~conformance.isolation.local.LocalExecutor`, and so also with ``--isolation=none``) under the
  warning filters the target's process has: a filter the target set (``ignore``, ``error``) still
  holds, and a warning shown "once per location" is shown once per case (each case starts a fresh
  registry), so its count is the number of cases that raised it. A filter the target sets *during* a call
  ends with that call (``warnings.catch_warnings`` restores the filters it found). They cross the pipe as
  data (``conformance.isolation.protocol.WarningSeen``, in the reply): the :data:`KEPT` most frequent of
  each call (:func:`kept_warnings`), with the number of distinct others, so a target that warns a new
  message in a loop still sends a small reply.
* **Lines on stdout and stderr**, Python's or native code's (a C++ logger writes to file descriptor 2):
  the worker's descriptors 1 and 2 are a file its parent made (``conformance.isolation.worker``), which
  the parent reads, as text, after each reply and when the worker ends (a crash's last words included).
  Only the op worker's: a tensor-parallel rank still writes to the terminal.

Everything is bounded: per case, :data:`KEPT` distinct warnings and lines (the others counted), each
line at most :data:`LINE_CHARS` characters, at most ``worker.OUTPUT_READ_BYTES`` bytes of output read per
reply (the rest counted in bytes). What is kept is text made safe to write (``conformance.text.safe_text``),
never run; the parent makes it so again on arrival (:meth:`TargetOutput.add_warnings`): a worker is not
trusted to have done it.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterable, Iterator

from conformance.text import safe_text

from .protocol import WarningSeen

KEPT = 20  # distinct warnings, and distinct lines, a case keeps (the most frequent)
LINE_CHARS = 500  # of one line or one warning's message


@contextlib.contextmanager
def collecting_warnings(into: list[WarningSeen]) -> Iterator[None]:
    """Record the warnings shown inside the block into ``into`` instead of printing them (the process's filters
    still decide which are shown)."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            counts = collections.Counter(
                (safe_text(getattr(w.category, "__name__", "Warning"), 200), safe_text(w.message, LINE_CHARS),
                 safe_text(f"{w.filename}:{w.lineno}", 300)) for w in caught)
            into.extend(WarningSeen(category, message, where, count) for (category, message, where), count in counts.items())


def kept_warnings(seen: Iterable[WarningSeen]) -> tuple[tuple[WarningSeen, ...], int]:
    """``seen`` with each distinct warning once (counts added), the :data:`KEPT` most frequent of them, and how many
    distinct others there were: what a reply carries."""
    counts: collections.Counter = collections.Counter()
    for warning in seen:
        counts[(warning.category, warning.message, warning.where)] += warning.count
    kept = counts.most_common(KEPT)
    return tuple(WarningSeen(category, message, where, count) for (category, message, where), count in kept), len(counts) - len(kept)


class TargetOutput:
    """A case's (or a worker start's) warnings and output lines, each distinct one counted."""

    def __init__(self) -> None:
        self.warnings: collections.Counter = collections.Counter()  # (category, message, where) → count
        self.lines: collections.Counter = collections.Counter()  # line → count
        self.omitted_warnings = 0  # distinct warnings the worker left out of its replies (kept_warnings)
        self.omitted_bytes = 0

    def __bool__(self) -> bool:
        return bool(self.warnings or self.lines or self.omitted_warnings or self.omitted_bytes)

    def add_warnings(self, seen: Iterable[WarningSeen], omitted: int = 0) -> None:
        """Warnings as a reply carries them (from another process: each text made safe and cut again here, a count
        below 1 read as 1), and ``omitted`` distinct others it left out."""
        for warning in seen:
            key = (safe_text(warning.category, 200), safe_text(warning.message, LINE_CHARS), safe_text(warning.where, 300))
            self.warnings[key] += max(1, warning.count)
        self.omitted_warnings += max(0, omitted)

    def add_text(self, text: str, omitted_bytes: int = 0) -> None:
        """Lines of output (blank ones dropped); ``omitted_bytes`` more were written but not read."""
        for line in text.splitlines():
            if line.strip():
                self.lines[safe_text(line.rstrip(), LINE_CHARS)] += 1
        self.omitted_bytes += omitted_bytes

    def add(self, other: TargetOutput) -> None:
        self.warnings.update(other.warnings)
        self.lines.update(other.lines)
        self.omitted_warnings += other.omitted_warnings
        self.omitted_bytes += other.omitted_bytes

    def to_json(self) -> dict:
        """``{"warnings": [{category, message, where, count}], "lines": [{text, count}], "total": {…}, "omitted": {…}}``:
        the :data:`KEPT` most frequent of each, how many there were in all, and how many distinct ones (and bytes)
        were left out."""
        warnings_kept = self.warnings.most_common(KEPT)
        lines_kept = self.lines.most_common(KEPT)
        return {
            "warnings": [{"category": c, "message": m, "where": w, "count": n} for (c, m, w), n in warnings_kept],
            "lines": [{"text": text, "count": n} for text, n in lines_kept],
            "total": {"warnings": sum(self.warnings.values()), "lines": sum(self.lines.values())},
            "omitted": {"warnings": len(self.warnings) - len(warnings_kept) + self.omitted_warnings,
                        "lines": len(self.lines) - len(lines_kept),
                        "bytes": self.omitted_bytes},
        }
