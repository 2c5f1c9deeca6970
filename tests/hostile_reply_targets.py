"""Targets whose process sends the referee something other than honest data (tests/isolation/test_hostile_replies.py).

Each wraps the correct ``hpu-emulated`` target. A target's code runs in the worker process, and so can
rewrite anything the worker sends: these do, on every answer to a call (``ok``), the ways a malicious
target or a careless vendor library could:

* the unpickling probes: the reply carries (or *is*) an object whose ``__reduce__`` would, when unpickled
  in the referee, replace the referee's judge so that everything passes, or scale its float64 products
  so that the oracle agrees with a wrong target; the target's outputs are wrong meanwhile
  (``MailsAJudgeReplacement``: 50 % of every add_lora_linear delta; ``MailsAFloat64Patch``: 30 %; both put
  the object into the answer itself, as a tensor subclass and a str subclass) or the bytes on the pipe
  are a pickle of it (``MailsAPickle``). The object's payload writes ``$HOSTILE_MARKER`` wherever it runs;
* frames the wire must refuse: a shape of 10¹² elements declared over a few bytes (``DeclaresAShapeBomb``),
  an unknown dtype (``DeclaresAnUnknownDtype``), bytes that do not match the declared shape
  (``TruncatesItsBytes``), an answer to the previous call (``AnswersAnotherCase``), a record of the wrong
  type (``MistypesItsAnswer``), a tensor the referee never handed over (``HandsBackAnExtraTensor``).
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import torch

from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.wire.frame import MAGIC, Channel

MARKER_ENV = "HOSTILE_MARKER"


def _payload(what: str) -> str:
    """Python that, run anywhere, leaves a mark and does ``what`` to the referee's modules."""
    return (f"import os; open(os.environ.get({MARKER_ENV!r}, '/dev/null'), 'a').write('ran in ' + str(os.getpid()) + chr(10)); "
            + what)


REPLACE_THE_JUDGE = _payload(
    "import conformance.referee as r, conformance.runner as u; from conformance.verdict import Outcome; "
    "from conformance.record import CaseResult; "
    "r.judge_op = u.judge_op = (lambda case, case_id, *a, **k: CaseResult(case_id, case, Outcome.PASS))")
PATCH_FLOAT64 = _payload(
    "import torch; m = torch.matmul; "
    "torch.matmul = lambda *a, **k: (lambda t: t * 1.3 if t.dtype == torch.float64 else t)(m(*a, **k))")


class Evil:
    """Unpickled, it runs ``code`` (``exec``): what a reply must never be able to do to the referee."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


class EvilTensor(torch.Tensor):
    code = REPLACE_THE_JUDGE

    def __reduce_ex__(self, protocol):
        return exec, (self.code,)


class EvilText(str):
    code = REPLACE_THE_JUDGE

    def __reduce__(self):
        return exec, (self.code,)


class _RewritesItsAnswers(HpuEmulatedTarget):
    """Wraps the worker's ``Channel.send`` (in its own process: the target's code can) and hands every answer to a
    call to :meth:`rewrite`, which sends what it likes instead."""

    def __init__(self) -> None:
        super().__init__()
        original = Channel.send
        rewrite = self.rewrite

        def send(channel, tag, body=None, *, timeout=None):
            if tag == "ok" and isinstance(body, dict) and "reply" in body:
                return rewrite(channel, body, lambda new_tag, new_body: original(channel, new_tag, new_body, timeout=timeout))
            return original(channel, tag, body, timeout=timeout)

        Channel.send = send

    def rewrite(self, channel, body: dict, send) -> None:
        raise NotImplementedError


def _raw_frame(channel, header: dict, data: bytes = b"") -> None:
    encoded = json.dumps(header).encode()
    os.write(channel.write_fd, struct.pack("<4sI", MAGIC, len(encoded)) + encoded + data)


class _WrongDelta(HpuEmulatedTarget):
    """Every add_lora_linear delta (LoRA bias included) ``factor`` times what it should be."""

    factor = 1.5

    def add_lora_linear(self, y, *args, **kwargs):
        before = y.clone()
        result = super().add_lora_linear(y, *args, **kwargs)
        y.copy_(before.float() + self.factor * (y.float() - before.float()))
        return result


class MailsAJudgeReplacement(_WrongDelta, _RewritesItsAnswers):
    """50 % wrong; every tensor and the message of its answer are objects that would replace the referee's judge."""

    name = "mails-a-judge-replacement"
    code = REPLACE_THE_JUDGE

    def rewrite(self, channel, body, send):
        tensor_type = type("Evil", (EvilTensor,), {"code": self.code})
        text_type = type("EvilText", (EvilText,), {"code": self.code})
        reply = body["reply"]
        reply["runs"] = [{name: tensor.as_subclass(tensor_type) for name, tensor in run.items()} for run in reply["runs"]]
        reply["message"] = text_type(reply["message"] or "all good")
        send("ok", body)


class MailsAFloat64Patch(MailsAJudgeReplacement):
    """30 % wrong; its answer's objects would make the referee's float64 products agree with it."""

    name = "mails-a-float64-patch"
    factor = 1.3
    code = PATCH_FLOAT64


class MailsAPickle(_WrongDelta, _RewritesItsAnswers):
    """50 % wrong; sends a pickle of an object that replaces the referee's judge instead of a frame."""

    name = "mails-a-pickle"

    def rewrite(self, channel, body, send):
        os.write(channel.write_fd, pickle.dumps(Evil(REPLACE_THE_JUDGE)))


class DeclaresAShapeBomb(_RewritesItsAnswers):
    name = "declares-a-shape-bomb"

    def rewrite(self, channel, body, send):
        _raw_frame(channel, {"tag": "ok", "body": {**body, "reply": {"status": "ran", "runs": [{"y": {"$tensor": 0}}]}},
                             "tensors": [{"dtype": "float32", "shape": [1_000_000, 1_000_000], "nbytes": 4 * 10**12}]}, b"\0" * 64)


class DeclaresAnUnknownDtype(_RewritesItsAnswers):
    name = "declares-an-unknown-dtype"

    def rewrite(self, channel, body, send):
        _raw_frame(channel, {"tag": "ok", "body": {**body, "reply": {"status": "ran", "runs": [{"y": {"$tensor": 0}}]}},
                             "tensors": [{"dtype": "object", "shape": [2], "nbytes": 16}]}, b"\0" * 16)


class TruncatesItsBytes(_RewritesItsAnswers):
    name = "truncates-its-bytes"

    def rewrite(self, channel, body, send):
        _raw_frame(channel, {"tag": "ok", "body": {**body, "reply": {"status": "ran", "runs": [{"y": {"$tensor": 0}}]}},
                             "tensors": [{"dtype": "float32", "shape": [4, 8], "nbytes": 100}]}, b"\0" * 100)


class AnswersAnotherCase(_RewritesItsAnswers):
    """Answers each call with the call number and case of the one before (the first with a made-up one)."""

    name = "answers-another-case"
    previous = (0, "some-other-case")

    def rewrite(self, channel, body, send):
        current = (body["seq"], body["case_id"])
        body["seq"], body["case_id"] = self.previous
        type(self).previous = current
        send("ok", body)


class MistypesItsAnswer(_RewritesItsAnswers):
    name = "mistypes-its-answer"

    def rewrite(self, channel, body, send):
        body["reply"]["runs"] = [{name: "a tensor, honestly" for name in run} for run in body["reply"]["runs"]]
        send("ok", body)


class HandsBackAnExtraTensor(_RewritesItsAnswers):
    name = "hands-back-an-extra-tensor"

    def rewrite(self, channel, body, send):
        for run in body["reply"]["runs"]:  # one tensor under a name the referee never used (as many tensors as asked)
            run["__class__"] = run.pop(next(iter(run)))
        send("ok", body)
