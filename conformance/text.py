"""Text from a target made safe to show and to write: whatever a target raises must become a case result.

A target's message is not trusted text. A driver's bytes decoded with ``surrogateescape`` leave lone
surrogates (``"\\udcff"``) that no UTF-8 writer accepts; a message can hold NULs and terminal escapes;
an exception's ``__str__`` can raise; a runtime can put a whole device log into one error. Each of these
once lost every case of a run (the Allure writer, report.html and junit.xml crashed) or made every
artifact hundreds of MB. So every message a target produces goes through this module before it is
stored:

* :func:`safe_text` turns any value into text that is valid UTF-8, has no control characters but
  newline and tab, and is at most ``limit`` characters long. It never raises.
* :func:`describe_exception` is ``"TypeName: message (at file:line)"`` for an exception, made with
  :func:`safe_text`; it never raises either, even when the exception's ``__str__``, ``__repr__`` or its
  type's ``__name__`` do.
* :func:`format_traceback` is the whole Python traceback of an exception, as Python prints it (every
  frame, the chained causes and contexts, the notes), in safe text of at most ``TRACEBACK_LIMIT``
  characters, each frame and each exception's message cut on its own first; it never raises.
* :func:`raised_at` is what raised and where, as data (``{"type": "TypeError", "frame":
  "my_backend/ops.py:HpuTarget.bgmv_shrink"}``): the exception's type and the innermost frame of the
  target's code, file and function without a line number, never a frame of the suite's own harness. It is
  made where :func:`format_traceback` is, in the target's process, so a report groups raised errors by
  cause (``conformance.report.clusters``) without reading traceback text.
* :func:`without_surrogates` escapes the surrogates in every string of a JSON-like value (a journal line
  written before this module existed may hold ``"\\udcff"``, which ``json.loads`` turns back into one).

A leaf module: it imports the standard library only, so anything (a worker process, a report tool) can
use it.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

# 8,000 characters: a whole Python traceback of some 40 frames (about 200 characters a frame) plus its
# message fits, so nothing a reader needs is cut from an ordinary error; yet a message is copied into
# several artifacts per case (the journal, results.json, junit.xml, the Allure result's message and
# trace, report.html), so 10,000 failing cases make at most some 80 MB of messages per artifact, not
# the 100 GB a 10 MB device log per case would.
MESSAGE_LIMIT = 8_000

# 32,000 characters: a traceback travels in one more field than its message (``traceback``: the journal,
# results.json, junit.xml's error text, the Allure trace, report.html), for broken cases only. A
# traceback of 40 frames (some 250 characters a frame with Python 3.11's markers under the failing
# expression) and a chained cause of as many frames fits whole; a deeper one keeps its head (where the
# suite called the target) and its tail (the innermost frames and what raised).
TRACEBACK_LIMIT = 32_000
# one part of a traceback: a frame, or one exception's "TypeName: message" line; a 10 MB message in one
# link of a chain must leave room for the other links' frames (the message itself is the record's
# ``message``, cut to MESSAGE_LIMIT)
TRACEBACK_PART_LIMIT = 2_000

# C0 controls but tab and newline, DEL, C1 controls: a NUL ends a C string, ESC drives a terminal, \x85
# and \x1c-\x1e split lines for str.splitlines; none of them belong in a report
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_NAMED = {"\r": "\\r"}
# the note that replaces the middle of a text cut to its limit; the longest note (for the longest text a
# str can be) fits into this many characters
_NOTE_ROOM = 48


def safe_text(value: object, limit: int = MESSAGE_LIMIT) -> str:
    """``value`` as text that every writer accepts; never raises, whatever ``value`` is or does.

    * a str is itself; bytes are decoded as UTF-8 with undecodable bytes shown as ``\\xff``; anything else
      is ``str(value)``, else ``repr(value)``, else a note saying what raised (``<RuntimeError object:
      str() raised ValueError, repr() raised ValueError>``); None is ``"None"``;
    * lone surrogates are shown as ``\\udcff``, control characters other than newline and tab as
      ``\\x00``, ``\\x1b`` or ``\\r`` (backslash escapes: the text stays readable and valid UTF-8);
    * text longer than ``limit`` characters keeps its head and its tail (where a traceback says what
      raised) around the note ``… [12,345,678 characters cut] …``; the result is at most ``limit``
      characters long (or the note alone, for a ``limit`` shorter than the note).

    ``safe_text(safe_text(x)) == safe_text(x)``: text that is safe already is returned as it is.
    """
    try:
        return _safe_text(value, limit)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a value can do anything when it is turned into text: say so instead
        try:
            return f"<{_type_name(value)} object: could not be turned into text>"
        except BaseException:  # noqa: BLE001
            return "<an object that could not be turned into text>"


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message (at file:line)"``: what raised, what it said (:func:`safe_text`) and the innermost
    frame of its traceback when it has one; never raises.

    An exception whose ``str()`` raises is described by its ``repr()``; when that raises too, the message
    says so (``RuntimeError: <str() raised ValueError; repr() raised ValueError>``). An empty message
    gives ``"TypeName"`` alone.
    """
    try:
        name = _type_name(exc)
        message = _message_of(exc)
        text = f"{name}: {message}" if message else name
        where = _innermost_frame(exc)
        if where:
            # the location stays visible however long the message: it is cut to leave room for it
            return safe_text(text, MESSAGE_LIMIT - len(where) - 1) + " " + where
        return safe_text(text)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - describing a failure must not fail
        return "<an exception that could not be described>"


def format_traceback(exc: BaseException) -> str:
    """The whole traceback of ``exc`` as Python prints it (``traceback.format_exception``): from the frame
    that caught it down to the one that raised it, then its notes, and before it the exceptions it was
    raised from or while handling (``__cause__``, ``__context__``); in safe text (:func:`safe_text`).

    Each part (a frame, an exception's message line, a note) is cut to ``TRACEBACK_PART_LIMIT``
    characters, the whole to ``TRACEBACK_LIMIT`` (keeping its head and its tail). Never raises: an
    exception that cannot even be formatted is described by :func:`describe_exception`.
    """
    try:
        parts = traceback.TracebackException.from_exception(exc, compact=True).format()
        text = "".join(_traceback_part(part) for part in parts).rstrip("\n")
        return safe_text(text, TRACEBACK_LIMIT)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a metaclass or a frame can make formatting raise: say what it was
        return describe_exception(exc)


# The suite's own code (this package) but for its built-in targets: a frame there is the harness that called
# the target, the reference, the referee, never where the target's code raised.
_SUITE = os.path.dirname(os.path.realpath(__file__))
_BUILT_IN_TARGETS = os.path.join(_SUITE, "targets")


def raised_at(exc: BaseException, target: object = None) -> dict[str, str]:
    """``{"type": ..., "frame": "file:function"}``: the type of ``exc`` and the innermost frame of its traceback
    that is the target's code; ``frame`` absent where no frame is. Never raises.

    The target's code: a frame outside this suite's package (its built-in targets, ``conformance/targets``,
    count as targets), preferring the frames of ``target``'s own package (the top-level package of its class's
    module) where ``target`` is given, so a target's call into a library (torch, triton) that raised is placed
    at the target's line that called it. The file is named relative to the ``sys.path`` entry it was imported
    from (``my_backend/ops.py``), the function by its qualified name (``HpuTarget.bgmv_shrink``); no line
    number, so one bug raising at two lines of one function is one place."""
    try:
        found = {"type": _type_name(exc)}
        frames = [code for code in _traceback_codes(exc) if not _is_suite(code.co_filename)]
        own = _package_roots(target) if target is not None else ()
        preferred = [code for code in frames if own and _under(os.path.realpath(code.co_filename), own)]
        chosen = (preferred or frames)[-1:] if frames else []
        if chosen:
            code = chosen[0]
            found["frame"] = safe_text(f"{_short_path(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}", 300)
        return found
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - describing a failure must not fail
        return {"type": "<unnamed type>"}


def _traceback_codes(exc: BaseException) -> list:
    """The code object of every frame of ``exc``'s traceback, outermost first (at most 10,000)."""
    codes, tb = [], exc.__traceback__
    while tb is not None and len(codes) < 10_000:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return codes


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _is_suite(filename: str) -> bool:
    path = os.path.realpath(filename)
    return _under(path, (_SUITE,)) and not _under(path, (_BUILT_IN_TARGETS,))


def _package_roots(target: object) -> tuple[str, ...]:
    """Where ``target``'s own code lies: its class's top-level package (its directories, or the module's
    file for a module of its own); the built-in targets' directory for a target of this suite."""
    module = sys.modules.get(type(target).__module__)
    top = sys.modules.get(getattr(module, "__name__", "").partition(".")[0])
    if top is None:
        return ()
    if top.__name__ == __name__.partition(".")[0]:
        return (_BUILT_IN_TARGETS,)
    paths = getattr(top, "__path__", None)
    if paths is not None:
        return tuple(os.path.realpath(path) for path in paths)
    return (os.path.realpath(top.__file__),) if getattr(top, "__file__", None) else ()


def _short_path(filename: str) -> str:
    """``filename`` relative to the deepest ``sys.path`` entry holding it (``my_backend/ops.py``), else its name."""
    path = os.path.realpath(filename)
    entries = [os.path.realpath(entry or os.curdir) for entry in sys.path if isinstance(entry, str)]
    holding = [entry for entry in entries if path.startswith(entry.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(holding, key=len)).replace(os.sep, "/") if holding else os.path.basename(filename)


def without_surrogates(value):
    """``value`` (a JSON-like structure: dicts, lists, strings, numbers) with every lone surrogate in its
    strings, keys included, escaped as ``\\udcff``; nothing else changes (nor is anything cut)."""
    if isinstance(value, str):
        return _SURROGATE.sub(_escape_char, value) if _SURROGATE.search(value) else value
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_surrogates(v) for v in value]
    return value


def _traceback_part(part: str) -> str:
    """One part of a formatted traceback, cut to ``TRACEBACK_PART_LIMIT``; it keeps its final newline."""
    if len(part) <= TRACEBACK_PART_LIMIT:
        return part
    return safe_text(part.rstrip("\n"), TRACEBACK_PART_LIMIT) + "\n"


def _safe_text(value: object, limit: int) -> str:
    text = _as_text(value)
    limit = max(int(limit), 0)
    if len(text) <= limit:
        escaped = _escape(text)
        if len(escaped) <= limit:
            return escaped
    return _cut(text, limit)


def _as_text(value: object) -> str:
    if type(value) is str:
        return value
    if isinstance(value, str):  # a subclass: its own methods may do anything
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    text, failures = _str_or_repr(value)
    return text if text is not None else f"<{_type_name(value)} object: {', '.join(failures)}>"


def _str_or_repr(value: object) -> tuple[str | None, list[str]]:
    """``str(value)``, else ``repr(value)`` (None when both raise), and what raised on the way
    (``"str() raised ValueError"``)."""
    failures = []
    for convert in (str, repr):
        try:
            text = convert(value)
            return (text if type(text) is str else str.__str__(text)), failures
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a value can do anything when it is turned into text
            failures.append(f"{convert.__name__}() raised {_type_name(exc)}")
    return None, failures


def _escape_char(match_or_char) -> str:
    char = match_or_char if isinstance(match_or_char, str) else match_or_char.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _escape(text: str) -> str:
    if _SURROGATE.search(text):
        text = _SURROGATE.sub(_escape_char, text)
    if _CONTROL.search(text):
        text = _CONTROL.sub(_escape_char, text)
    return text


def _cut(text: str, limit: int) -> str:
    """``text`` escaped, its middle replaced by a note saying how many of its characters were left out, at
    most ``limit`` characters in all; two thirds of the room go to the head, the rest to the tail."""
    room = max(limit - _NOTE_ROOM, 0)
    if not room:
        return f"… [{len(text):,} characters cut]"
    head, head_used = _fit(text[:room], room * 2 // 3, from_end=False)
    rest = text[head_used:]
    tail, tail_used = _fit(rest, room - len(head), from_end=True)
    return f"{head} … [{len(text) - head_used - tail_used:,} characters cut] … {tail}"


def _fit(text: str, room: int, *, from_end: bool) -> tuple[str, int]:
    """The escaped form of as many characters of ``text`` as fit into ``room`` characters, taken from its
    start (or its end), and how many characters of ``text`` that is."""
    if room <= 0 or not text:
        return "", 0
    chunk = text[-room:] if from_end else text[:room]
    escaped = _escape(chunk)
    if len(escaped) <= room:
        return escaped, len(chunk)
    parts, size = [], 0  # escapes made it longer: character by character (at most ``room`` of them)
    for char in reversed(chunk) if from_end else chunk:
        piece = _escape(char)
        if size + len(piece) > room:
            break
        parts.append(piece)
        size += len(piece)
    if from_end:
        parts.reverse()
    return "".join(parts), len(parts)


def _type_name(value: object) -> str:
    try:
        name = type(value).__name__
        if type(name) is str and name:
            return _escape(name)[:200]
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a metaclass can make even this raise
        pass
    return "<unnamed type>"


def _message_of(exc: BaseException) -> str:
    """What ``str(exc)`` says; its ``repr()`` when that raises; else a note naming what raised."""
    text, failures = _str_or_repr(exc)
    if text is None:
        return f"<{'; '.join(failures)}>"
    return f"{text} ({failures[0]})" if failures else text


def _innermost_frame(exc: BaseException) -> str:
    """``(at file:line)`` of the innermost frame of ``exc``'s traceback; "" without one."""
    try:
        tb = exc.__traceback__
        if tb is None:
            return ""
        seen = 0
        while tb.tb_next is not None and seen < 10_000:  # a traceback is a chain; bounded all the same
            tb = tb.tb_next
            seen += 1
        filename = tb.tb_frame.f_code.co_filename
        return f"(at {safe_text(filename, 300)}:{int(tb.tb_lineno)})"
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001
        return ""
