"""What a target's process sends back is data, never code: the wire refuses anything else, and a case whose
reply was refused is *broken* (``malformed reply``) with what was wrong, never a pass, an exception in the
referee or a memory blow-up (tests/hostile_reply_targets.py).

The frame reader is tested on bytes written into a pipe by hand (unit tier); the hostile targets run in
the real worker process, through the op level (integration tier); the unpickling probes of issue 31 run
as whole ``pytest conformance`` sessions, the way a vendor's CI would run them.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conformance.generator import profile_cases
from conformance.isolation import IsolatedExecutor
from conformance.levels import OP
from conformance.verdict import FailureKind, Outcome
from conformance.wire import Channel, Limits, WireError, from_data
from conformance.wire.frame import MAGIC

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


# -- the frame reader, on bytes written by hand ---------------------------------------------------------


def frame(header, data: bytes = b"", *, magic: bytes = MAGIC) -> bytes:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<4sI", magic, len(encoded)) + encoded + data


def read(raw: bytes, limits: Limits | None = None):
    """``raw`` written into a pipe (closed after it), read back by the referee's end."""
    limits = limits or Limits()
    read_fd, write_fd = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(write_fd, raw), os.close(write_fd)))
    writer.start()
    channel = Channel(read_fd, None)
    try:
        return channel.receive(limits)
    finally:
        writer.join()
        channel.close()


def tensor(dtype="float32", shape=(2,), nbytes=None) -> dict:
    size = {"float32": 4, "float16": 2}.get(dtype, 1)
    return {"dtype": dtype, "shape": list(shape), "nbytes": nbytes if nbytes is not None else size * int(torch.tensor(shape).prod())}


@pytest.mark.parametrize(("raw", "words"), [
    pytest.param(b"\x80\x04\x95" + b"x" * 20, "not a frame of the wire", id="a pickle"),
    pytest.param(frame(b"{not json"), "not UTF-8 JSON", id="not json"),
    pytest.param(frame(b"\xff\xfe"), "not UTF-8 JSON", id="not utf-8"),
    pytest.param(frame({"tag": "ok", "body": {}}), "exactly tag, body and tensors", id="no tensor list"),
    pytest.param(frame({"tag": 3, "body": {}, "tensors": []}), "the tag is int", id="a tag that is no string"),
    pytest.param(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor(shape=(10**6, 10**6))]}, b"\0" * 64),
                 "more than", id="a shape bomb"),
    pytest.param(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor("object", nbytes=16)]}, b"\0" * 16),
                 "dtype 'object' is not one of", id="an unknown dtype"),
    pytest.param(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor(shape=(4, 8), nbytes=100)]}, b"\0" * 100),
                 "truncated or padded", id="bytes that do not match the shape"),
    pytest.param(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor(shape=(-1, 2))]}, b""),
                 "non-negative integers", id="a negative dim"),
    pytest.param(frame({"tag": "ok", "body": {"$tensor": 1}, "tensors": [tensor()]}, b"\0" * 8),
                 "not one unused index", id="a reference to no tensor"),
    pytest.param(frame({"tag": "ok", "body": [{"$tensor": 0}, {"$tensor": 0}], "tensors": [tensor()]}, b"\0" * 8),
                 "not one unused index", id="one tensor twice"),
    pytest.param(frame({"tag": "ok", "body": {}, "tensors": [tensor()]}, b"\0" * 8), "referenced nowhere", id="a tensor unused"),
    pytest.param(frame({"tag": "ok", "body": "[" * 100_000 + "]" * 100_000, "tensors": []}), None, id="deep text is text"),
    pytest.param(frame(b'{"tag": "ok", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b', "tensors": []}'), "not UTF-8 JSON",
                 id="deep nesting"),
])
def test_the_frame_reader_refuses_what_is_not_a_frame_of_data(raw, words):
    if words is None:
        assert read(raw).tag == "ok"
        return
    with pytest.raises(WireError, match=words):
        read(raw)


def test_the_reader_checks_sizes_before_it_allocates_and_the_header_before_it_reads_it():
    with pytest.raises(WireError, match="at most 1,024 are allowed"):
        read(struct.pack("<4sI", MAGIC, 2**31), Limits(header_bytes=1024))  # 2 GiB of header declared: nothing read
    limits = Limits(tensor_bytes=100)
    with pytest.raises(WireError, match="more than 100 bytes"):
        read(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor(shape=(26,))]}, b"\0" * 104), limits)
    assert read(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor(shape=(25,))]}, b"\0" * 100), limits).body.shape == (25,)
    with pytest.raises(EOFError):  # a frame cut off by the writer's death
        read(frame({"tag": "ok", "body": {"$tensor": 0}, "tensors": [tensor(shape=(25,))]}, b"\0" * 50))


def test_typed_records_follow_the_declared_type_never_the_data():
    from conformance.target_call import TargetCall

    with pytest.raises(WireError, match="runs\\[0\\]\\['y'\\]: expected a tensor, got str"):
        from_data(TargetCall, {"status": "ran", "runs": [{"y": "a tensor, honestly"}]})
    with pytest.raises(WireError, match="status: expected one of"):
        from_data(TargetCall, {"status": "passed"})
    with pytest.raises(WireError, match="unknown: \\['__class__'\\]"):
        from_data(TargetCall, {"status": "ran", "__class__": "os.system"})
    with pytest.raises(WireError, match="seconds: expected a number, got bool"):
        from_data(TargetCall, {"status": "ran", "seconds": True})


# -- hostile targets in the real worker -----------------------------------------------------------------


def cases() -> list[tuple[str, object]]:
    """Two float32 add_lora_linear cases and one bgmv_shrink case of the smoke profile that serve an adapter."""
    found = [(i, c) for i, c in profile_cases("smoke", 0) if c.dtype == "float32" and any(s != -1 for s in c.token_slots)]
    return [x for x in found if x[1].op == "add_lora_linear"][:2] + [x for x in found if x[1].op == "bgmv_shrink"][:1]


HOSTILE = {
    "DeclaresAShapeBomb": "more than",
    "DeclaresAnUnknownDtype": "dtype 'object' is not one of",
    "TruncatesItsBytes": "truncated or padded",
    "AnswersAnotherCase": "not call",
    "MistypesItsAnswer": "expected a tensor, got str",
    "HandsBackAnExtraTensor": "tensors the referee never handed over",
    "MailsAPickle": "not a frame of the wire",
}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_reply_the_wire_refuses_is_a_broken_case_naming_what_was_wrong(name, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("HOSTILE_MARKER", str(tmp_path / "marker"))
    executor = IsolatedExecutor(f"hostile_reply_targets:{name}", case_timeout=60)
    try:
        results = [OP.run(SimpleNamespace(executor=executor, repeat=2, require_deterministic=False), i, c) for i, c in cases()]
    finally:
        executor.close()
    for result in results:
        assert (result.outcome, result.kinds) == (Outcome.BROKEN, (FailureKind.MALFORMED_REPLY,)), (result.case_id, result.message)
        assert HOSTILE[name] in result.message and "nothing in it was judged" in result.message, result.message
    assert executor.restarts == len(results) - 1  # each refused reply cost its worker; the next case had a new one
    assert not (tmp_path / "marker").exists()


def conformance(target: str, report_dir: Path, marker: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", f"--target={target}", "--profile=smoke",
               "--report-dir", str(report_dir), *args]
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HOSTILE_MARKER": str(marker)}
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    document = json.loads((report_dir / "results.json").read_text())
    return completed, {r["id"]: r for r in document["results"]}


@pytest.mark.integration
@pytest.mark.parametrize(("name", "outcome", "kind"), [
    ("MailsAJudgeReplacement", "fail", None),  # the object rode in the answer: the answer is data, judged as such
    ("MailsAFloat64Patch", "fail", None),
    ("MailsAPickle", "broken", "malformed reply"),  # the pipe held a pickle: refused unread
])
def test_the_unpickling_probes_fail_honestly_and_the_referee_runs_none_of_their_code(name, outcome, kind, tmp_path):
    """Issue 31's probes: targets 50 % (30 %) wrong whose replies carry objects that, unpickled in the referee, made
    every case pass. On the smoke profile's add_lora_linear cases every case that serves an adapter must fail."""
    marker = tmp_path / "marker"
    completed, results = conformance(f"hostile_reply_targets:{name}", tmp_path / "report", marker, "-n", "2", "-k", "add_lora_linear")
    assert completed.returncode == 1 and "verdict: FAIL" in completed.stdout, completed.stdout[-3000:]
    assert not marker.exists(), marker.read_text()  # its payload ran nowhere: not in the referee, not even in the worker
    served = {case_id for case_id, case in profile_cases("smoke", 0) if case.op == "add_lora_linear"
              and any(slot != -1 and slot not in case.disabled_slots for slot in case.token_slots) and case.scale != 0}
    assert served and served <= set(results)
    wrong = {case_id: results[case_id] for case_id in served}
    assert all(r["outcome"] == outcome for r in wrong.values()), {i: (r["outcome"], r["message"][:200]) for i, r in wrong.items()
                                                                   if r["outcome"] != outcome}
    if kind:
        assert all(r["kind"] == kind for r in wrong.values())
