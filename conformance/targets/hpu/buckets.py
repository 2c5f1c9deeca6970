"""Buckets: row counts padded up to a few static sizes, as Gaudi runtimes pad batches.

On Gaudi every new input shape is a new graph compilation (seconds), so vLLM's HPU runners pad the
batch size and sequence length up to *buckets* and warm each bucket up once
(docs/gaudi-lora.md §3.3, §4). The LoRA ops then see only bucket-sized tensors: padded rows get
slot −1, so they carry no adapter and their results are thrown away.

A :class:`BucketPolicy` maps a row count to its bucket:

* ``pow2`` (default): the next power of two, at least ``minimum`` (``pow2:16`` → 16, 16, 32, 64 …);
* an explicit ascending list (``"8,16,32,128"``), like a warmed-up bucket list; a count above the
  largest bucket goes to the next power of two (on Gaudi that is a not-warmed-up shape: a compile);
* ``none``: no padding (every row count is its own shape; only for comparison and debugging).
"""

from __future__ import annotations

from dataclasses import dataclass


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


@dataclass(frozen=True)
class BucketPolicy:
    sizes: tuple[int, ...] = ()  # explicit buckets, ascending; empty = powers of two
    minimum: int = 1  # smallest power-of-two bucket
    enabled: bool = True

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)) or any(s < 1 for s in self.sizes):
            raise ValueError(f"bucket sizes must be distinct positive integers in ascending order, got {self.sizes}")
        if self.minimum < 1:
            raise ValueError(f"the minimum bucket must be ≥ 1, got {self.minimum}")

    def bucket(self, rows: int) -> int:
        """The padded row count for ``rows`` rows (0 stays 0: there is nothing to run)."""
        if rows < 0:
            raise ValueError(f"a row count cannot be negative, got {rows}")
        if rows == 0 or not self.enabled:
            return rows
        for size in self.sizes:
            if size >= rows:
                return size
        return max(_next_power_of_two(rows), self.minimum, self.sizes[-1] if self.sizes else 1)

    @classmethod
    def none(cls) -> BucketPolicy:
        return cls(enabled=False)

    @classmethod
    def from_spec(cls, spec: str | None) -> BucketPolicy:
        """``"pow2"`` / ``"pow2:MIN"`` / ``"none"`` / ``"8,16,32"``; ``None`` or ``""`` gives the default."""
        spec = (spec or "pow2").strip().lower()
        if spec == "none":
            return cls.none()
        if spec == "pow2" or spec.startswith("pow2:"):
            minimum = spec.partition(":")[2]
            return cls(minimum=int(minimum) if minimum else 1)
        try:
            return cls(sizes=tuple(int(part) for part in spec.split(",")))
        except ValueError:
            raise ValueError(f"bucket spec {spec!r} is not 'pow2', 'pow2:MIN', 'none' or a list like '8,16,32'") from None

    def describe(self) -> str:
        if not self.enabled:
            return "none"
        if self.sizes:
            return ",".join(map(str, self.sizes))
        return "pow2" if self.minimum == 1 else f"pow2:{self.minimum}"
