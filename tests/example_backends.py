"""The example backends of docs/bring-up.md (``examples/``), as the project's tests load them.

``scripts/install-cpu-env`` installs each with ``pip install --no-deps -e``; a test that needs one and
finds it missing fails saying so, never skips.
"""

from __future__ import annotations

import importlib

import pytest


def installed_example(module: str, class_name: str, directory: str) -> type:
    """The example's target class, or a test failure naming the install command."""
    try:
        return getattr(importlib.import_module(module), class_name)
    except ImportError:
        pytest.fail(f"the example backend is not installed: pip install --no-deps -e examples/{directory} "
                    "(scripts/install-cpu-env does it)")
