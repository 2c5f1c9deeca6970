"""Where the fixture models live and how one is read: a checkpoint and its PEFT adapters, from disk.

Each side of an end-to-end case reads them itself: the target's side (its engine runs the model) and the
referee (its float64 reference runs it, :class:`conformance.e2e.referee.FixtureModel`). Nothing read here
runs a target's code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .adapters import Adapter
from .cases import MODEL_ADAPTERS
from .checkpoint import Checkpoint

FIXTURES_ENV = "LORA_CONFORMANCE_FIXTURES"


GENERATOR = "make_fixtures.py"  # in every fixtures directory: what tells one from a stray directory of that name


def fixtures_dir() -> Path:
    """Where the end-to-end fixtures are read from, for every reader (the referee, the target's side, the tests).

    ``$LORA_CONFORMANCE_FIXTURES`` if set; else the fixtures shipped in an installed wheel
    (``conformance/fixtures/`` in the package, mapped there from the repository's ``fixtures/`` by
    pyproject.toml's ``package-dir``); else the checkout's top-level ``fixtures/`` (a source tree or an
    editable install, whose ``conformance`` package is the checkout's). If neither holds the generator, the
    wheel's place, for :meth:`FixtureFiles.load` to name.
    """
    if env := os.environ.get(FIXTURES_ENV):
        return Path(env)
    package = Path(__file__).resolve().parents[1]
    candidates = (package / "fixtures", package.parent / "fixtures")  # installed wheel; checkout
    return next((c for c in candidates if (c / GENERATOR).is_file()), candidates[0])


@dataclass(frozen=True)
class FixtureFiles:
    """One fixture model's checkpoint and its adapters (by directory name), read and checked."""

    checkpoint: Checkpoint
    adapter_dirs: dict[str, Path]
    adapters: dict[str, Adapter]

    @classmethod
    def load(cls, fixtures: Path, model: str) -> FixtureFiles:
        """``FileNotFoundError`` when the model is missing, ``ValueError`` for a malformed file."""
        model_dir = fixtures / model
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"end-to-end fixtures not found at {model_dir}: run `python fixtures/make_fixtures.py` in the "
                f"repository, or point ${FIXTURES_ENV} at a fixtures directory"
            )
        checkpoint = Checkpoint.load(model_dir)
        adapters_dir = fixtures / MODEL_ADAPTERS[model]
        adapter_dirs = {p.name: p for p in sorted(adapters_dir.iterdir()) if p.is_dir()} if adapters_dir.is_dir() else {}
        adapters = {name: Adapter.load(path, checkpoint.config, checkpoint.weights) for name, path in adapter_dirs.items()}
        return cls(checkpoint, adapter_dirs, adapters)
