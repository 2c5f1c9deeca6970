"""A ``device_sum`` case: how many float32 values to sum, and the seed they are drawn from."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.query import case_id

LEVEL = "device_sum"


@dataclass(frozen=True)
class DeviceSumCase:
    length: int
    seed: int
    op: str = LEVEL  # the record's op, dtype and family: the reports group results by them
    dtype: str = "float32"
    family: str = "reduction"

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"a device_sum case sums at least one value, got length {self.length!r}")

    @property
    def case_id(self) -> str:
        """The case's parameters in the suite's id grammar (``conformance.query``): ``device_sum:float32:length=4096;seed=3``."""
        return case_id(LEVEL, "float32", {"length": self.length, "seed": self.seed})

    def features(self) -> frozenset[str]:
        return frozenset({"long" if self.length > 4096 else "short"})

    def to_json(self) -> dict:
        return {"length": self.length, "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict) -> DeviceSumCase:
        return cls(int(data["length"]), int(data["seed"]))
