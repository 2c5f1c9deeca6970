"""A disk cache of drawn profiles: drawing thousands of cases with Hypothesis takes seconds per process.

The key covers everything the drawing depends on: profile, seed, op and dtype filters, the versions of
Hypothesis and Python, and the source of the modules that define strategies, cases and ops. A changed
strategy therefore never reuses a stale list. Set ``LORA_CONFORMANCE_CACHE=off`` to disable it, or to
a directory to move it (default: ``~/.cache/lora-conformance``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from conformance.cases.case import Case

_PACKAGE = Path(__file__).resolve().parents[1]
_SOURCES = ("generator", "ops", "cases/case.py")


def _source_digest() -> str:
    digest = hashlib.sha256()
    for entry in _SOURCES:
        path = _PACKAGE / entry
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(source.relative_to(_PACKAGE).as_posix().encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


# Taken once, when the generator is imported, so that it describes the code this process draws
# with: a digest read later could describe an edited file the process never loaded.
_SOURCE_DIGEST = _source_digest()


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


def cached_cases(key: dict, draw: Callable[[], list[tuple[str, Case]]]) -> list[tuple[str, Case]]:
    """``draw()``'s result, from the cache when an identical drawing was done before."""
    directory = _cache_dir()
    if directory is None:
        return draw()
    full_key = {**key, "hypothesis": hypothesis_version(), "python": sys.version_info[:2], "source": _SOURCE_DIGEST}
    name = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:32]
    path = directory / f"profile-{name}.json"
    if path.is_file():
        try:
            return [(case_id, Case.from_json(data)) for case_id, data in json.loads(path.read_text())]
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable cache entry is redrawn and rewritten
    drawn = draw()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps([(case_id, case.to_json()) for case_id, case in drawn]))
        temporary.replace(path)  # atomic: parallel workers never read a half-written file
    except OSError:
        pass  # a read-only home is no reason to fail a run
    return drawn
