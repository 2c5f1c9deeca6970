"""The private Hypothesis API of conformance/compat.py: its patch takes effect with the pinned version,
and a moved internal is a clear error, never a silent change of behaviour."""

from __future__ import annotations

import pytest
from hypothesis.internal.conjecture import providers

from conformance import compat
from conformance.compat import CompatError, without_hypothesis_local_constants


def test_the_pool_of_local_constants_is_empty_inside_the_block_and_restored_after():
    before = providers._get_local_constants
    assert before().integers  # what the block is for: literals of the modules this process imported
    with without_hypothesis_local_constants():
        assert not providers._get_local_constants().integers
    assert providers._get_local_constants is before


def test_a_moved_hypothesis_internal_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(providers, "_get_local_constants")
    with pytest.raises(CompatError, match=r"hypothesis .* no longer has .*_get_local_constants.*constraints/cpu.txt"):
        with without_hypothesis_local_constants():
            pass


def test_compat_is_the_only_module_that_touches_private_apis():
    import re
    from pathlib import Path

    package = Path(compat.__file__).parent
    # pytest's private package as a word of its own: the distribution name allure_pytest is not it
    private = re.compile(r"\b_pytest\b|hypothesis\.internal")
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "compat.py" and private.search(path.read_text())
    ]
    assert offenders == []
