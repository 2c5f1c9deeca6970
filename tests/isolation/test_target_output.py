"""What a target says besides its answers (``conformance.isolation.output``): its Python warnings and its lines
on stdout and stderr are collected per case, as bounded, safe text, and never reach the terminal.

The first tests run the collecting in this process; the others run target halves that warn, print, flood,
forge and crash (``tests/chatty_halves.py``) in a real worker (``IsolatedExecutor``) on the ``reference``
target, as a case's target half runs.
"""

from __future__ import annotations

import warnings

import pytest
from chatty_halves import ChattyWarning

from conformance.isolation.output import KEPT, LINE_CHARS, TargetOutput, collecting_warnings, kept_warnings
from conformance.isolation.process import IsolatedExecutor
from conformance.isolation.protocol import WarningSeen
from conformance.isolation.worker import DEFAULT_LIMITS, OUTPUT_READ_BYTES, Breakdown
from conformance.verdict import FailureKind


def warn_three_times(message: str) -> None:
    for _ in range(3):
        warnings.warn(message, ChattyWarning, stacklevel=1)  # one location


def test_warnings_are_recorded_under_the_process_filters_and_not_printed(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # Python's own for a UserWarning: once per location
        warnings.filterwarnings("ignore", message="hidden")  # as a target may set at import
        per_case = []
        for _ in range(2):
            into: list[WarningSeen] = []
            with collecting_warnings(into):
                warn_three_times("shown")
                warn_three_times("hidden")
            per_case.append(into)
        warnings.simplefilter("always")
        always: list[WarningSeen] = []
        with collecting_warnings(always):
            warn_three_times("shown")
    assert capsys.readouterr().err == ""
    # once per location is once per case: each case starts with a fresh registry, so the count is of cases
    for into in per_case:
        assert [(w.category, w.message, w.count) for w in into] == [("ChattyWarning", "shown", 1)]
        assert into[0].where.endswith(f"test_target_output.py:{warn_three_times.__code__.co_firstlineno + 2}")
    assert [(w.message, w.count) for w in always] == [("shown", 3)]


def test_a_reply_keeps_the_most_frequent_warnings_and_counts_the_others():
    seen = [WarningSeen("W", f"message {i}", "f.py:1", 1) for i in range(KEPT + 30)]
    seen += [WarningSeen("W", "frequent", "f.py:2", 5), WarningSeen("W", "frequent", "f.py:2", 2)]
    kept, omitted = kept_warnings(seen)
    assert len(kept) == KEPT and omitted == KEPT + 30 + 1 - KEPT
    assert (kept[0].message, kept[0].count) == ("frequent", 7)


def test_what_another_process_sent_is_made_safe_and_bounded_again():
    output = TargetOutput()
    output.add_warnings([WarningSeen("\x1b[31mForged", "\x1b[2J" + "A" * 100_000, "here:1", -7)], omitted=-3)
    lines = [f"line {i}" for i in range(KEPT + 5)]
    output.add_text("\n".join(lines + ["", "   ", "line 0", "\x1b[2Jcleared " + "B" * 10_000]) + "\n", omitted_bytes=123)
    said = output.to_json()
    [warning] = said["warnings"]
    assert warning["count"] == 1 and len(warning["message"]) <= LINE_CHARS and warning["message"].startswith("\\x1b[2JAAA")
    assert warning["category"] == "\\x1b[31mForged" and said["omitted"]["warnings"] == 0
    assert len(said["lines"]) == KEPT and said["lines"][0] == {"text": "line 0", "count": 2}
    assert said["total"] == {"warnings": 1, "lines": len(lines) + 2}  # blank lines are not lines
    assert said["omitted"] == {"warnings": 0, "lines": len(lines) + 1 - KEPT, "bytes": 123}
    assert all("\x1b" not in line["text"] and len(line["text"]) <= LINE_CHARS for line in said["lines"])
    assert not TargetOutput() and output


@pytest.fixture(scope="module")
def worker():
    with pytest.MonkeyPatch.context() as patch:
        # as a lab's shell has it: Python's -u (which CI's environment sets) would make C's stdio unbuffered too
        patch.delenv("PYTHONUNBUFFERED", raising=False)
        executor = IsolatedExecutor("reference", case_timeout=120)
        executor.start()
    yield executor
    executor.close()


def call(executor: IsolatedExecutor, half: str, **request) -> tuple[object, dict]:
    """Run ``chatty_halves:half`` as a case's target half; its answer and what the target said in it."""
    executor.take_output()  # what an earlier test left is not this call's
    answer = executor.call("op", f"chatty_halves:{half}", f"case-{half}", request, limits=DEFAULT_LIMITS)
    return answer, executor.take_output().to_json()


@pytest.mark.integration  # a worker process
def test_each_case_gets_its_own_warnings_and_lines_from_python_native_code_and_c_stdio(worker):
    for number in (1, 2):
        answer, said = call(worker, "warns_and_prints", n=3, call=number)
        assert answer == "ok"
        assert sorted((w["category"], w["message"], w["count"]) for w in said["warnings"]) == [
            ("ChattyWarning", f"call number {number}", 1), ("ChattyWarning", "the same deprecation every time", 1)]
        # the C printf is block-buffered to a file: the worker flushes C's buffers before it replies
        assert sorted(line["text"] for line in said["lines"]) == sorted(
            [f"python print of call {number}", f"native stderr of call {number}", f"C printf of call {number}"])


@pytest.mark.integration  # a worker process
def test_a_flood_stays_bounded_and_the_case_still_answers(worker):
    answer, said = call(worker, "floods", n=KEPT + 480, kib=200)
    assert answer == "ok"  # nothing the target says can make its reply too large to be read
    assert len(said["warnings"]) == KEPT and said["omitted"]["warnings"] == 480
    assert said["lines"] == [{"text": "x" * 127, "count": OUTPUT_READ_BYTES // 128}]
    assert said["omitted"]["bytes"] == 200 * 1024 - OUTPUT_READ_BYTES
    # the rest of the flood was skipped, not left for the next case
    answer, said = call(worker, "writes_odd_bytes")
    assert [line["text"] for line in said["lines"]] == ["bad bytes \\xff\\xfe\\x80 end", "\\x1b[2Jcleared the screen"]


@pytest.mark.integration  # a worker process
def test_a_forged_warning_record_is_made_safe_on_arrival(worker):
    answer, said = call(worker, "forges_its_warnings")
    assert answer == "ok"
    [warning] = said["warnings"]
    assert warning["category"] == "\\x1b[31mForged" and warning["count"] == 1 and said["omitted"]["warnings"] == 0
    assert len(warning["message"]) <= LINE_CHARS and "\x1b" not in warning["message"]


@pytest.mark.integration  # a worker process
def test_a_crashed_case_keeps_the_last_words_it_wrote_and_the_next_worker_starts_clean(worker):
    worker.take_output()
    with pytest.raises(Breakdown) as raised:
        worker.call("op", "chatty_halves:last_words_then_abort", "case-abort", {}, limits=DEFAULT_LIMITS)
    assert raised.value.kind == FailureKind.CRASHED
    assert [line["text"] for line in worker.take_output().to_json()["lines"]] == ["F0000 fatal: the device ran out of patience"]
    answer, said = call(worker, "warns_and_prints", n=1, call=3)
    assert answer == "ok" and not any("fatal" in line["text"] for line in said["lines"])
