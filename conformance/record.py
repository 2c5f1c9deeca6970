"""One case's result, at any level: the typed record every front end, journal and report reads.

Op cases (``conformance.referee``), tensor-parallel layer cases (``conformance.tp``) and end-to-end
model cases (``conformance.e2e``) all end as a :class:`CaseResult` (the last two as subclasses that add
their own fields); :meth:`CaseResult.to_json` is the results schema of ``results.json``. Every message
is made safe to write here, whatever the target put into it (``conformance.text``): a surrogate, a
control character or ten megabytes cannot break an artifact.

Determinism (``stability``): a case's target call is repeated on fresh copies of its inputs
(``--repeat``), and a failure is attempted once more:

* ``deterministic``: every call gave bit-identical results;
* ``nondeterministic``: the calls differ bit for bit (``determinism`` says by how much); a pass stays a
  pass unless ``--require-deterministic``;
* ``flaky``: the verdict itself did not repeat (a call or an attempt passed, another failed); a flaky
  failure still fails the gate.

What the target raised (``traceback``): a case whose target raised (outcome *broken*, kind ``raised``)
keeps the whole Python traceback, formatted in the target's process (``conformance.text.format_traceback``:
the suite's frames from where it called the target, the target's frames, the chained causes), so a
vendor can debug a failure inside an interop layer from the report alone. A crash or a timeout raised
nothing: its message names the signal and the last Python frames, and ``traceback`` stays None; so
does every other outcome's. Beside it, as data, ``raised``: the exception's type and the innermost frame of
the target's code (``{"type": "TypeError", "frame": "my_backend/ops.py:HpuTarget.bgmv_shrink"}``, made in
the same process by ``conformance.text.raised_at``), which the report's clusters group raised errors by.
``results.json`` holds either field only where it is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.cases.case import Case
from conformance.ops import OP_SPECS, Level
from conformance.text import TRACEBACK_LIMIT, safe_text
from conformance.verdict import FailureKind, Measurement, Outcome

STABILITIES = ("deterministic", "nondeterministic", "flaky")


@dataclass
class CaseResult:
    case_id: str
    case: Case
    outcome: Outcome
    message: str = ""
    measurement: Measurement | None = None
    features: frozenset[str] = field(default_factory=frozenset)
    seconds: float = 0.0
    failing_slots: tuple[int, ...] = ()  # the slots of the output rows where a problem shows
    failing_slices: tuple[int, ...] = ()  # the output slices where a problem shows (−1: columns outside every slice)
    expectation: dict | None = None  # the expectations entry that matched, if any
    replay: str | None = None  # the replay file written for this case, if any
    repro: str | None = None  # the one-line command that reruns it
    kinds: tuple[FailureKind, ...] = ()  # how it went wrong (empty for a pass), most telling first
    stability: str | None = None  # see the module docstring; None: not measured (one call, or none ran)
    determinism: dict | None = None  # runs, attempts, differing elements, largest difference between calls
    traceback: str | None = None  # what the target raised, formatted in its process (see the module docstring)
    raised: dict[str, str] | None = None  # its type and the target's innermost frame (see the module docstring)
    # what the verdict was reached on (conformance.digest): the digest of the input values the run drew and
    # handed to the target (None where none were: not supported), and the float64 oracle's fingerprint
    # (None where the level has no single oracle output, or the op is judged by its invariants)
    inputs_digest: str | None = None
    oracle_fingerprint: list[float] | None = None
    # where it wrote outside its region: whether every element it changed there is now zero (None: it did not)
    outside_zeroed: bool | None = None

    @property
    def kind(self) -> FailureKind | None:
        return self.kinds[0] if self.kinds else None

    @property
    def level(self) -> Level | str:
        """The level the record names: an op's (kernel or wrapper); a level of another kind says its own
        (a ``Level`` of the built-in ones, or the name of a level an installed package adds)."""
        return OP_SPECS[self.case.op].level

    def measurement_json(self) -> dict | None:
        return self.measurement.to_json() if self.measurement else None

    def to_json(self) -> dict:
        """The results schema (results.json, the report, merge): one record per case, at any level;
        ``traceback`` and ``raised`` only where the target raised, ``outside_zeroed`` only where it wrote outside its
        region."""
        record = {
            "id": self.case_id,
            "op": self.case.op,
            "level": self.level.value if isinstance(self.level, Level) else str(self.level),
            "dtype": self.case.dtype,
            "family": self.case.family,
            "features": sorted(self.features),
            "outcome": self.outcome.value,
            "kind": self.kind.value if self.kind else None,
            "kinds": [kind.value for kind in self.kinds],
            "message": safe_text(self.message),
            "measurement": self.measurement_json(),
            "seconds": round(self.seconds, 4),
            "failing_slots": list(self.failing_slots),
            "failing_slices": list(self.failing_slices),
            "expectation": self.expectation,
            "replay": self.replay,
            "repro": self.repro,
            "stability": self.stability,
            "determinism": self.determinism,
            "case": self.case.to_json(),
            "inputs_digest": self.inputs_digest,
            "oracle_fingerprint": self.oracle_fingerprint,
        }
        if self.outside_zeroed is not None:
            record["outside_zeroed"] = self.outside_zeroed
        if self.traceback is not None:
            record["traceback"] = safe_text(self.traceback, TRACEBACK_LIMIT)
        if self.raised is not None:
            record["raised"] = {safe_text(key, 40): safe_text(value, 300) for key, value in self.raised.items()}
        return record
