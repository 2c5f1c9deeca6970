"""A tensor-parallel rank's exception becomes the pool's ``raised`` failure in safe text (``conformance.text``):
a lone surrogate, a NUL or a terminal escape in its message, or a ``__str__`` and ``__repr__`` that raise,
crash neither the rank's answer nor the pool, which ends so that the next case starts a fresh one.

The targets are defined here and loaded by name in every rank (the ranks get this process's ``sys.path``).
"""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist
from test_tp_pool import case_of

from conformance.targets.reference import ReferenceTarget
from conformance.tp.composition import tensors_of
from conformance.tp.pool import RankFailure, RankPool
from conformance.verdict import FailureKind

UNSAFE = re.compile(r"[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f]")


class Unprintable(RuntimeError):
    def __str__(self):
        raise ValueError("the device handle is gone")

    def __repr__(self):
        raise ValueError("the device handle is gone")


class Rank1RaisesSurrogates(ReferenceTarget):
    name = "rank1-raises-surrogates"

    def add_lora_linear(self, *args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("hccl said \udcff at \x00 \x1b[31mred\x1b[0m")
        super().add_lora_linear(*args, **kwargs)


class Rank1RaisesUnprintable(ReferenceTarget):
    name = "rank1-raises-unprintable"

    def add_lora_linear(self, *args, **kwargs):
        if dist.get_rank() == 1:
            raise Unprintable()
        super().add_lora_linear(*args, **kwargs)


@pytest.mark.parametrize(
    "target, words",
    [
        ("Rank1RaisesSurrogates", "RuntimeError: hccl said \\udcff at \\x00 \\x1b[31mred\\x1b[0m"),
        ("Rank1RaisesUnprintable", "Unprintable: <str() raised ValueError; repr() raised ValueError>"),
    ],
)
def test_a_rank_raising_a_hostile_message_is_a_raised_failure_in_safe_text(target, words):
    pool = RankPool(f"test_tp_hostile_messages:{target}", 2)
    try:
        with pytest.raises(RankFailure) as failure:
            case = case_of("column", False, 2)
            pool.run(case, tensors_of(case), 60)
        message = failure.value.message
        assert failure.value.kind is FailureKind.RAISED and failure.value.ranks == (1,), message
        assert "rank 1 of 2 raised while running this case" in message and words in message, message
        assert not UNSAFE.search(message), message
        assert not pool.alive  # ended: the next case starts a fresh pool
    finally:
        pool.close(kill=True)
