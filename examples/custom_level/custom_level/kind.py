"""The ``device_sum`` level: its cases, one call into the target's worker per case, the judged result."""

from __future__ import annotations

import time

import torch

from conformance.levels import BREAKDOWNS, CaseKind, LevelContext
from conformance.record import CaseResult
from conformance.verdict import Outcome
from conformance.wire import Limits, WireError

from .case import LEVEL, DeviceSumCase
from .judge import draw, judge

LENGTHS = {"smoke": (1, 1000, 65536), "standard": (1, 7, 1000, 4096, 65536, 1 << 20)}
REPLY_LIMITS = Limits(header_bytes=1 << 20, tensor_bytes=64, tensors=1, dims=1)  # one float32: anything larger is refused


class DeviceSumResult(CaseResult):
    @property
    def level(self) -> str:
        return LEVEL


def read_answer(data) -> torch.Tensor:
    """The worker's answer, checked: one float32 value, else the case is broken (a malformed reply)."""
    total = data.get("sum") if isinstance(data, dict) else None
    if not isinstance(total, torch.Tensor) or total.dtype != torch.float32 or total.shape != (1,):
        raise WireError(f"a device_sum answer is {{'sum': one float32}}, got {type(data).__name__} {data!r:.120}")
    return total


class DeviceSumKind(CaseKind):
    name = LEVEL
    markers = {LEVEL: "a case of the device_sum level (examples/custom_level): a float32 sum on the target's device"}
    result_type = DeviceSumResult
    target_half = "custom_level.half:serve"

    def owns(self, case) -> bool:
        return isinstance(case, DeviceSumCase)

    def cases(self, profile: str, seed: int) -> list[tuple[str, DeviceSumCase]]:
        lengths = LENGTHS.get(profile, LENGTHS["standard"])
        return [(case.case_id, case) for case in (DeviceSumCase(n, seed * 1000 + i) for i, n in enumerate(lengths))]

    def run(self, context: LevelContext, case_id: str, case: DeviceSumCase, values=None) -> CaseResult:
        values = draw(case.length, case.seed) if values is None else values  # drawn here, in the referee
        started = time.perf_counter()
        try:
            total = context.executor.call(self.name, self.target_half, case_id, {"values": values},
                                          limits=REPLY_LIMITS, parse=read_answer)
        except BREAKDOWNS as exc:
            return self.broken_by(exc, case_id, case, time.perf_counter() - started)
        passed, message, _ = judge(values, total)
        return self.result_type(case_id, case, Outcome.PASS if passed else Outcome.FAIL, message,
                                features=self.features(case), seconds=time.perf_counter() - started)


DEVICE_SUM = DeviceSumKind()
