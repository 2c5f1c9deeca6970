"""A frozen case list: exactly the cases a certification run judges, drawn once and stored as data.

A profile's cases are drawn by Hypothesis from a seed: another Hypothesis version may draw others under
the same ids, so two vendors on two versions would be judged on two populations. A case list freezes one
drawing: ``conformance/caselists/<name>.jsonl``, one JSON object per line:

* line 1, the header: ``{"caselist": name, "format": 1, "suite_version", "profile", "seed", "count",
  "digest", "generated_with": {"hypothesis", "torch", "python"}}``;
* then one line per case, in run order: ``{"id": the query-style case id, "level": "op" | "model" |
  "layer", "case": the case's JSON, "inputs": the digest of the input values the referee draws for it}``.

``digest`` is SHA-256 over the case lines as stored (the header excluded), so it names the list's
content: the same ids, cases and input digests give the same digest. ``--caselist NAME|PATH`` runs the
list without drawing anything (no Hypothesis import); the results record the list's name and digest, and
every result the digest of the inputs it ran on, which ``lora-conformance verify`` checks against the list.

The input digests are of values drawn with torch's CPU generator from each case's seed, in float64,
then rounded to the case dtype. A torch build that draws other values (none measured so far) would not
run the list's cases; a run checks the first op cases' inputs against the list before it starts and
refuses, naming both torch versions, rather than judge other inputs under the list's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conformance.digest import sha256

FORMAT = 1
CASELISTS_DIR = Path(__file__).parent
HEADER_FIELDS = ("caselist", "format", "suite_version", "profile", "seed", "count", "digest", "generated_with")
ENTRY_FIELDS = ("id", "level", "case", "inputs")


class CaselistError(ValueError):
    """A case list that cannot be read, named with what is wrong and the fix."""


@dataclass(frozen=True)
class CaselistEntry:
    case_id: str
    level: str  # the name of the CaseKind that owns the case (conformance.levels)
    case_json: dict
    inputs_digest: str

    def to_json(self) -> dict:
        return {"id": self.case_id, "level": self.level, "case": self.case_json, "inputs": self.inputs_digest}


@dataclass(frozen=True)
class Caselist:
    name: str
    path: Path
    header: dict
    entries: tuple[CaselistEntry, ...]

    @property
    def digest(self) -> str:
        return self.header["digest"]

    @property
    def profile(self) -> str:
        return self.header["profile"]

    @property
    def seed(self) -> int:
        return self.header["seed"]

    @property
    def by_id(self) -> dict[str, CaselistEntry]:
        return {entry.case_id: entry for entry in self.entries}

    def summary(self) -> dict:
        """What a run's manifest and results record of the list it ran."""
        return {"name": self.name, "digest": self.digest, "count": len(self.entries)}


def entry_line(entry: CaselistEntry) -> str:
    return json.dumps(entry.to_json(), sort_keys=True, separators=(",", ":"))


def lines_digest(lines: list[str]) -> str:
    return sha256("".join(line + "\n" for line in lines).encode())


def released_caselists() -> dict[str, Path]:
    """The lists this release of the suite ships, by name."""
    return {path.stem: path for path in sorted(CASELISTS_DIR.glob("*.jsonl"))}


def caselist_path(name_or_path: str | Path) -> Path:
    """A shipped list's path by name, or the path given; ``CaselistError`` naming the shipped ones."""
    released = released_caselists()
    if str(name_or_path) in released:
        return released[str(name_or_path)]
    path = Path(name_or_path)
    if path.is_file():
        return path
    raise CaselistError(
        f"no case list {str(name_or_path)!r}: give a shipped list's name ({', '.join(released) or 'none shipped'}) "
        "or the path of a .jsonl list (python -m conformance.caselists write … makes one)"
    )


def load_caselist(name_or_path: str | Path) -> Caselist:
    """Read and check a list: its header, every line's fields, unique ids, the count and the digest."""
    path = caselist_path(name_or_path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CaselistError(f"cannot read the case list {path}: {exc}") from None
    lines = text.splitlines()
    if not lines:
        raise CaselistError(f"the case list {path} is empty; regenerate it (python -m conformance.caselists write)")
    header = _json_line(path, 1, lines[0])
    missing = [field for field in HEADER_FIELDS if field not in header]
    if missing or header.get("format") != FORMAT:
        raise CaselistError(f"{path} line 1 is no format-{FORMAT} case-list header (missing {missing or 'nothing'}, "
                            f"format {header.get('format')!r}); regenerate it with this suite's python -m conformance.caselists write")
    entries, seen = [], set()
    for number, line in enumerate(lines[1:], start=2):
        data = _json_line(path, number, line)
        if sorted(data) != sorted(ENTRY_FIELDS) or not all(isinstance(data[f], str) for f in ("id", "level", "inputs")) \
                or not isinstance(data["case"], dict):
            raise CaselistError(f"{path} line {number}: a case line holds exactly {list(ENTRY_FIELDS)} (id, level and inputs "
                                f"strings, case an object), got {sorted(data)}")
        if data["id"] in seen:
            raise CaselistError(f"{path} line {number}: the case id {data['id']!r} is listed twice")
        seen.add(data["id"])
        entries.append(CaselistEntry(data["id"], data["level"], data["case"], data["inputs"]))
    if header["count"] != len(entries):
        raise CaselistError(f"{path}: the header counts {header['count']} cases, the file holds {len(entries)}: truncated or edited")
    digest = lines_digest(lines[1:])
    if header["digest"] != digest:
        raise CaselistError(f"{path}: the header's digest {header['digest']} is not its cases' digest {digest}: the list was "
                            "edited after it was written; regenerate it (python -m conformance.caselists write)")
    return Caselist(str(header["caselist"]), path, header, tuple(entries))


def _json_line(path: Path, number: int, line: str) -> dict:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CaselistError(f"{path} line {number} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CaselistError(f"{path} line {number} is not a JSON object")
    return data


def write_caselist(path: Path, name: str, header: dict, entries: list[CaselistEntry]) -> Caselist:
    """Write a list (``header`` without its count and digest, which are computed here) and read it back."""
    lines = [entry_line(entry) for entry in entries]
    full = {**header, "caselist": name, "format": FORMAT, "count": len(lines), "digest": lines_digest(lines)}
    path.write_text(json.dumps({field: full[field] for field in HEADER_FIELDS}, sort_keys=False) + "\n" + "".join(line + "\n" for line in lines))
    return load_caselist(path)
