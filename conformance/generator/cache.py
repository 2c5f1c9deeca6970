"""A disk cache of drawn profiles: drawing thousands of cases with Hypothesis takes seconds per process.

The key covers what the drawing reads, and nothing else: the profile, seed, op and dtype filters and
family names (``profiles.profile_key``); per op drawn, the fields of its spec that are not callables
(name, level, knobs, max_slices, rows, routed_weight …, read generically so a new field counts at
once; :func:`drawn_spec_fields`); the versions of Hypothesis and Python; and the source of the modules
the drawing runs (:data:`DRAWING_SOURCES`: the strategy, the families, the limits, the profiles, the
example drawing, the case and its knobs). A changed strategy or spec field therefore never reuses a
stale list, while editing how an op's values are filled, how it is called, its written region or its
reference (the spec's callables, which the drawing never calls) keeps the cached profiles. Set
``LORA_CONFORMANCE_CACHE=off`` to disable it, or to a directory to move it (default:
``~/.cache/lora-conformance``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from conformance.cases.case import Case

_PACKAGE = Path(__file__).resolve().parents[1]
# The modules a drawing runs, relative to the package: the profile loop (profiles), the strategy and
# the families it asks at every step, their limits, the example drawing and its Hypothesis shim
# (compat), and the case the strategy builds with its knobs' defaults (knobs.py where it exists).
DRAWING_SOURCES = (
    "generator/profiles.py", "generator/strategies.py", "generator/families.py", "generator/limits.py",
    "generator/drawing.py", "compat.py", "cases/case.py", "cases/knobs.py",
)  # fmt: skip


def _source_digest() -> str:
    digest = hashlib.sha256()
    for entry in DRAWING_SOURCES:
        path = _PACKAGE / entry
        if path.is_file():  # the name goes in too, so a module appearing or going away changes the key
            digest.update(entry.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# Taken once, when the generator is imported, so that it describes the code this process draws
# with: a digest read later could describe an edited file the process never loaded.
_SOURCE_DIGEST = _source_digest()


def _plain(value: Any) -> Any:
    """``value`` as JSON data, the same in every process: sets sorted, enums by value, mappings by key."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(item) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def drawn_spec_fields(spec) -> dict[str, Any]:
    """What the drawing can read of an op's spec (``conformance.ops.OpSpec``): every field whose value is not
    callable, read generically so that a field added to the spec counts without a change here. A callable
    (``make_values``, ``make_call``, ``written_mask``, ``reference``, ``check``) only shows as present:
    the drawing never calls one, but it may ask whether there is one (``check`` is not None)."""
    fields = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        fields[f.name] = "<callable>" if callable(value) else _plain(value)
    return fields


def hypothesis_version() -> str | None:
    """The Hypothesis that draws the op cases (None where it is not installed), read without importing it:
    a run whose profile is cached never needs Hypothesis, and importing it costs seconds per process (more
    where pytest's assertion rewriting of plugin packages cannot reuse its bytecode, e.g. with
    PYTHONDONTWRITEBYTECODE set). The cache keys on it, the manifest records it, a merge compares it."""
    module = sys.modules.get("hypothesis")
    if module is not None:
        return module.__version__
    try:
        return metadata.version("hypothesis")
    except metadata.PackageNotFoundError:
        return None


def _cache_dir() -> Path | None:
    setting = os.environ.get("LORA_CONFORMANCE_CACHE", "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "lora-conformance"


_READ: dict[str, tuple] = {}  # cache files this process read, by name: cases are frozen, the lists are copies


def cached_cases(key: dict, draw: Callable[[], list[tuple[str, Case]]]) -> list[tuple[str, Case]]:
    """``draw()``'s result, from the cache when an identical drawing was done before."""
    directory = _cache_dir()
    if directory is None:
        return draw()
    full_key = {**key, "hypothesis": hypothesis_version(), "python": sys.version_info[:2], "source": _SOURCE_DIGEST}
    name = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:32]
    path = directory / f"profile-{name}.json"
    if name in _READ:  # a run asks for its profile several times (its entries, its manifest, its workers' start)
        return list(_READ[name])
    if path.is_file():
        try:
            cases = [(case_id, Case.from_json(data)) for case_id, data in json.loads(path.read_text())]
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable cache entry is redrawn and rewritten
        else:
            _READ[name] = tuple(cases)
            return cases
    drawn = draw()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps([(case_id, case.to_json()) for case_id, case in drawn]))
        temporary.replace(path)  # atomic: parallel workers never read a half-written file
    except OSError:
        pass  # a read-only home is no reason to fail a run
    return drawn
