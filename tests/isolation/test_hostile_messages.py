"""Whatever a target raises becomes a case result, and every artifact is still written.

A target's exception is not trusted text: a driver's bytes decoded with ``surrogateescape`` leave lone
surrogates no UTF-8 writer accepts, a message can hold NULs and terminal escapes, an exception's
``__str__`` and ``__repr__`` can raise, and a runtime can put a 10 MB device log into one error. Each
misbehaving target here (tests/misbehaving_targets.py) raises such an exception in every
``add_lora_linear`` call; on the selection of tests/isolation/test_crash_isolation.py (2 add_lora_linear
and 3 bgmv_shrink smoke cases) the run must end by itself with the gate's verdict, record every case
(the add_lora_linear ones broken, kind raised), write report.html, junit.xml and one Allure result per
case, keep every artifact small, and ``python -m conformance.report html DIR`` must rebuild the report
from the journals afterwards (also from a journal written before messages were made safe text).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from misbehaving_targets import RaisesSurrogates, UnprintableError

from conformance.isolation.protocol import RemoteError
from conformance.wire import from_data, to_data

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "isolation") not in sys.path:
    sys.path.insert(0, str(TESTS / "isolation"))

from test_crash_isolation import CASE_TIMEOUT, ROOT, conformance, nodeids, selection  # noqa: E402

ARTIFACT_LIMIT = 2_000_000  # bytes: a 10 MB message must not make any artifact anywhere near its size
UNSAFE = re.compile(r"[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what conformance.text escapes

# target class → what the broken cases' messages must hold
HOSTILE = {
    "RaisesSurrogates": ("driver said \\udcff\\udcfe at \\x00 then \\x1b[31mred\\x1b[0m: simulated device failure",),
    "RaisesUnprintable": ("UnprintableError", "str() raised ValueError"),
    "RaisesHugeMessage": ("synapse log: simulated device failure", "characters cut"),
}


def rebuild(report_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance.report", "html", str(report_dir)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def check_artifacts(report_dir: Path, linear: list[str], shrink: list[str], words: tuple[str, ...]) -> None:
    """results.json, report.html, junit.xml and allure-results of a run that ended with the linear cases
    broken (raised) and the shrink cases passed; every artifact strict UTF-8 and under ARTIFACT_LIMIT."""
    document = json.loads((report_dir / "results.json").read_text(encoding="utf-8"))
    by_id = {r["id"]: r for r in document["results"]}
    assert sorted(by_id) == sorted(linear + shrink) and document["missing"] == []
    for case_id in linear:
        record = by_id[case_id]
        assert (record["outcome"], record["kind"]) == ("broken", "raised"), record
        assert all(w in record["message"] for w in words), record["message"][:2000]
        assert not UNSAFE.search(record["message"]), record["message"][:2000]
    assert all(by_id[case_id]["outcome"] == "pass" for case_id in shrink)
    assert not document["gate"]["passed"] and "2 case(s) ended broken" in document["gate"]["reasons"]

    report = (report_dir / "report.html").read_text(encoding="utf-8")  # strict: no lone surrogate got in
    assert "FAIL" in report and all(case_id in report for case_id in linear) and "raised" in report
    assert "\x00" not in report and "\x1b" not in report
    junit = (report_dir / "junit.xml").read_text(encoding="utf-8")
    assert "broken [raised]" in junit and all(case_id in junit for case_id in linear)

    allure = report_dir / "allure-results"
    results = [json.loads(path.read_text(encoding="utf-8")) for path in allure.glob("*-result.json")]
    named = sorted(case_id for r in results for case_id in linear + shrink if f"[{case_id}]" in r.get("name", ""))
    assert named == sorted(linear + shrink), [r.get("name") for r in results]
    broken = [r for r in results if any(f"[{case_id}]" in r.get("name", "") for case_id in linear)]
    assert {r["status"] for r in broken} == {"broken"}
    assert all("broken [raised]" in r["statusDetails"]["message"] for r in broken)

    sizes = {str(p.relative_to(report_dir)): p.stat().st_size for p in report_dir.rglob("*") if p.is_file()}
    assert max(sizes.values()) < ARTIFACT_LIMIT, sorted(sizes.items(), key=lambda item: -item[1])[:5]


@pytest.mark.parametrize(
    "name, isolation",
    [(name, "process") for name in HOSTILE] + [("RaisesSurrogates", "none")],
    ids=lambda value: value,
)
def test_a_hostile_message_becomes_a_result_and_every_artifact_is_written(tmp_path, name, isolation):
    linear, shrink = selection()
    completed = conformance(
        f"--target=misbehaving_targets:{name}", f"--isolation={isolation}", f"--case-timeout={CASE_TIMEOUT}",
        *nodeids(linear + shrink), report_dir=tmp_path,
    )  # fmt: skip
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.returncode == 1, output  # ended by itself (conformance() has a timeout), with the gate's verdict
    assert "INTERNALERROR" not in completed.stdout + completed.stderr, output
    check_artifacts(tmp_path, linear, shrink, HOSTILE[name])

    before = (tmp_path / "report.html").stat().st_mtime_ns
    (tmp_path / "results.json").unlink()
    rebuilt = rebuild(tmp_path)
    assert rebuilt.returncode == 1 and rebuilt.stdout.startswith("verdict: FAIL"), rebuilt.stdout + rebuilt.stderr
    assert (tmp_path / "report.html").stat().st_mtime_ns > before
    check_artifacts(tmp_path, linear, shrink, HOSTILE[name])


def test_a_journal_holding_surrogates_is_rebuilt_and_resumed(tmp_path):
    """A journal written before messages were made safe text holds ``"\\udcff"`` (JSON for a lone
    surrogate), control characters and a 10 MB message; rebuilding and ``--resume`` read it all the same."""
    linear, shrink = selection()
    ids = linear[:1] + shrink
    completed = conformance("--target=misbehaving_targets:RaisesDeviceError", *nodeids(ids), report_dir=tmp_path)
    assert completed.returncode == 1, completed.stdout[-3000:]
    journal = next((tmp_path / "results").glob("*.jsonl"))
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    for record in records:
        if record["id"] == linear[0]:
            record["message"] = "driver said \udcff\x00\x1b[0m\x85 " + "log line\n" * 1_000_000
    kept = [r for r in records if r["id"] != shrink[-1]]  # as if the run was killed before its last case
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))  # ensure_ascii: "\udcff" as JSON escapes
    (tmp_path / "results.json").unlink()

    rebuilt = rebuild(tmp_path)
    assert rebuilt.returncode == 1 and rebuilt.stdout.startswith("verdict: FAIL"), rebuilt.stdout + rebuilt.stderr
    document = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert document["missing"] == [shrink[-1]]
    message = {r["id"]: r for r in document["results"]}[linear[0]]["message"]
    assert message.startswith("driver said \\udcff\\x00\\x1b[0m\\x85 log line") and "characters cut" in message
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert linear[0] in report and "driver said \\udcff" in report
    assert (tmp_path / "report.html").stat().st_size < ARTIFACT_LIMIT

    resumed = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--resume", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    assert resumed.returncode == 1, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    document = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert sorted(r["id"] for r in document["results"]) == sorted(ids) and document["missing"] == []
    (tmp_path / "report.html").read_text(encoding="utf-8")


def test_the_worker_sends_back_an_exception_as_safe_text_and_the_referee_raises_only_builtins():
    """``conformance.isolation.protocol.RemoteError``: what the worker process sends its parent for an exception
    (text, across the wire as data) and what the parent raises for it: the builtin of that name, else RuntimeError."""

    class Local(Exception):  # a class of the worker's that the referee must never look up
        pass

    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:  # noqa: BLE001
            return caught

    def across(exc: BaseException) -> Exception:
        data = json.loads(json.dumps(to_data(RemoteError.of(raised(exc)))))
        return from_data(RemoteError, data).exception("the isolated worker process 1")

    clean = across(ValueError("plain"))
    assert type(clean) is ValueError and "ValueError: plain" in str(clean) and "raised in the isolated worker process" in str(clean)
    for exc, words in (
        (UnprintableError("x"), "UnprintableError: <str() raised ValueError; repr() raised ValueError>"),
        (RuntimeError(RaisesSurrogates.MESSAGE), "RuntimeError: driver said \\udcff\\udcfe at \\x00 then \\x1b[31m"),
        (RuntimeError("y" * 10_000_000), "characters cut"),
        (Local("local"), "Local: local"),
    ):
        sent = across(exc)
        text = str(sent)
        assert type(sent) is RuntimeError and words in text and "raised in the isolated worker process" in text, text[:500]
        assert not UNSAFE.search(text.replace("\n", "")) and len(text) < 60_000
    # a type name the worker chose is looked up among the builtin exceptions only
    for name in ("SystemExit", "KeyboardInterrupt", "exec", "__import__", "os.system", "UnicodeDecodeError"):
        assert type(RemoteError(name, "text").exception("a worker")) is RuntimeError, name
