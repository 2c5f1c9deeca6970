"""Target halves (``module:function``, run by ``LocalExecutor.call`` in a worker) that say things the ways a
target's framework does, besides answering: Python warnings, Python prints, native writes to file descriptor 2,
C ``printf`` (block-buffered when stdout is a file), bytes that are not UTF-8, more than a reply's worth of output,
last words before a crash; and one that forges what the reply carries about its warnings, as a hostile target
can (its code runs in the worker). ``tests/isolation/test_target_output.py`` calls them through
``IsolatedExecutor.call``.

Each takes ``(executor, request)`` as every target half does; ``request`` says how much (``{"n": 3}``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

from conformance.isolation.protocol import WarningSeen


class ChattyWarning(UserWarning):
    """What these halves warn: a category of their own, so a test tells theirs from anyone else's."""


def warns_and_prints(executor, request):
    """``n`` times the same warning (from one place), one warning with the call's own number, a print, a native
    line on descriptor 2 and a C ``printf`` line without a flush; answers ``"ok"``."""
    for _ in range(request["n"]):
        warnings.warn("the same deprecation every time", ChattyWarning, stacklevel=1)
    warnings.warn(f"call number {request['call']}", ChattyWarning, stacklevel=1)
    print(f"python print of call {request['call']}")
    os.write(2, f"native stderr of call {request['call']}\n".encode())
    ctypes.CDLL(None).printf(f"C printf of call {request['call']}\n".encode())
    return "ok"


def floods(executor, request):
    """``n`` distinct warnings and ``kib`` KiB of output, then 5 bytes that are not UTF-8 and an escape sequence."""
    for i in range(request["n"]):
        warnings.warn(f"distinct warning {i}", ChattyWarning, stacklevel=1)
    line = b"x" * 127 + b"\n"  # 8 a KiB
    os.write(1, line * 8 * request["kib"])
    return "ok"


def writes_odd_bytes(executor, request):
    """A line of bytes that are not UTF-8, and one with a terminal escape sequence (both must reach the report as
    readable text, not as what they would do to a terminal)."""
    os.write(2, b"bad bytes \xff\xfe\x80 end\n\x1b[2Jcleared the screen\n")
    return "ok"


def forges_its_warnings(executor, request):
    """Replaces what the worker sends about its warnings for this call: a 1 MB message with a terminal escape
    sequence, a count below zero, a negative number of others left out."""
    executor.take_warnings = lambda: ((WarningSeen("\x1b[31mForged", "\x1b[2J" + "A" * 1_000_000, "nowhere:0", -7),), -3)
    return "ok"


def last_words_then_abort(executor, request):
    """Says why on stderr (as a framework's fatal-error handler does), then aborts."""
    print("F0000 fatal: the device ran out of patience", file=sys.stderr, flush=True)
    os.abort()
