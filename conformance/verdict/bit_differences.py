"""Equal values with other bits: what the verdict records where it compares values, and never fails.

What must stay as it was (the output outside its written region, every input) is compared by value
(``conformance.verdict.metrics.compare_values``): a LoRA op's output is added into the base layer's,
where +0 and −0 are equal and add to the same value, and no later op of inference tells them, or two
NaN payloads, apart. A backend that adds a masked zero to a row without an adapter (−0 + +0 = +0), or
that round-trips an input through another framework, changes such bits and no number. The suite
records them (a :class:`BitDifferences` per tensor, in the measurement and so in ``results.json``) and
says so in the message of a passing case, with :meth:`BitDifferences.note`; docs/verdict.md gives the
rule. Determinism still compares bit for bit (``metrics.spread``): it measures reproducibility.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .metrics import ValueComparison, where

OUTPUT = "output"  # the role of the op's output, where only its untouched region is compared


@dataclass(frozen=True)
class BitDifferences:
    """The elements of one tensor whose value is unchanged and whose bits are not."""

    tensor: str  # its name ("output" for the op's output)
    role: str  # OUTPUT (outside its written region), "input" or "metadata"
    signed_zeros: int  # zeros whose sign flipped
    nan_payloads: int  # NaNs that stayed NaN with another payload or sign
    rows: tuple[int, ...] = ()  # where, as a Problem says it (dim −2, dim −1, the dims before flattened)
    columns: tuple[int, ...] = ()
    planes: tuple[int, ...] = ()

    @classmethod
    def of(cls, comparison: ValueComparison, tensor: str, role: str, region: torch.Tensor | None = None) -> BitDifferences | None:
        """The bit-level differences of ``comparison`` (within the bool mask ``region``, if given); None without any."""
        signed_zeros, nan_payloads = comparison.signed_zeros, comparison.nan_payloads
        if region is not None:
            signed_zeros, nan_payloads = signed_zeros & region, nan_payloads & region
        either = signed_zeros | nan_payloads
        if not either.any():
            return None
        return cls(tensor, role, int(signed_zeros.sum()), int(nan_payloads.sum()), **where(either))

    def note(self) -> str:
        """"bit-level difference only: 2 zero(s) changed sign outside the written region (equal values; not a wrong number)"."""
        changes = []
        if self.signed_zeros:
            changes.append(f"{self.signed_zeros} zero(s) changed sign")
        if self.nan_payloads:
            changes.append(f"{self.nan_payloads} NaN(s) changed payload or sign")
        place, verdict = ("outside the written region", "not a wrong number") if self.role == OUTPUT else (
            f"in the {self.role} {self.tensor!r}", f"not a modified {self.role}")
        return f"bit-level difference only: {' and '.join(changes)} {place} (equal values; {verdict})"

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "role": self.role, "signed_zeros": self.signed_zeros, "nan_payloads": self.nan_payloads,
                "rows": list(self.rows), "columns": list(self.columns), "planes": list(self.planes)}

    @classmethod
    def from_json(cls, record: dict) -> BitDifferences:
        """From :meth:`to_json`'s record (``results.json``, a journal): the report words it as the verdict did."""
        return cls(str(record["tensor"]), str(record["role"]), int(record["signed_zeros"]), int(record["nan_payloads"]),
                   tuple(record.get("rows") or ()), tuple(record.get("columns") or ()), tuple(record.get("planes") or ()))


def bit_level_notes(entries: tuple[BitDifferences, ...], name_rows: Callable[[tuple[int, ...]], str] | None = None) -> tuple[str, ...]:
    """One sentence per entry, for a message; ``name_rows`` puts the output's rows into words (the
    caller knows their slots), ``describe_rows`` of ``conformance.referee`` for instance."""
    return tuple(f"{entry.note()}: {name_rows(entry.rows)}" if name_rows and entry.role == OUTPUT and entry.rows else entry.note()
                 for entry in entries)
