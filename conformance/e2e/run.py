"""Running one end-to-end case on one target and judging it, like ``conformance.runner`` for op cases.

A case has two halves that exchange plain data only, so that each can run in a process of its own:

* the referee (:mod:`conformance.e2e.referee`): the float64 reference, the suite's decoder on the golden
  reference target, and the judgement. :meth:`E2EReferee.continuations` draws the reference's greedy
  tokens; :meth:`E2EReferee.judge` judges a production against the reference;
* the target's side (:mod:`conformance.e2e.target_runner`): the target's engine, either the suite's
  decoder through its wrapper methods (``generation_engine = "decoder"``) or the installed vLLM engine on
  its device (``generation_engine = "vllm"``: the ``cpu``, ``cuda`` and ``vllm-hpu`` targets).
  :meth:`E2ETargetRunner.produce` runs the case's batches, teacher-forced on the referee's continuations,
  and returns an :class:`~conformance.e2e.production.E2EProduction`.

:class:`E2ERunner` composes both in one process (tests, scripts, ``--isolation=none``); the harness runs the
target's side in the target's worker process and the referee in its own, where no target's code runs.

The MoE model's cases need the MoE LoRA wrapper methods (``add_lora_w13``, ``add_lora_w2``,
docs/moe.md) and run the suite's decoder only: on a vLLM engine target they are not supported (see
``moe_unsupported_reason``). So are the parallel-block model's: they judge one ``add_lora_linear`` call of
5 packed slices, which vLLM's own model of that architecture never makes (``PACKED_5_ON_VLLM``). So are the
token classifier's: their adapters save whole heads, which vLLM 0.32 refuses on a token-classification model
(``TOKEN_CLASSIFICATION_ON_VLLM``).
"""

from __future__ import annotations

from pathlib import Path

from .cases import E2ECase
from .fixture_files import FIXTURES_ENV, fixtures_dir
from .generation import Generation
from .production import E2EProduction
from .referee import E2EReferee, E2EResult, FixtureModel, GeneratedTokens
from .target_runner import (
    MOE_WRAPPER_METHODS,
    PACKED_5_ON_VLLM,
    TOKEN_CLASSIFICATION_ON_VLLM,
    WRAPPER_METHODS,
    E2ETargetRunner,
    moe_unsupported_reason,
)

__all__ = [
    "FIXTURES_ENV",
    "MOE_WRAPPER_METHODS",
    "PACKED_5_ON_VLLM",
    "TOKEN_CLASSIFICATION_ON_VLLM",
    "WRAPPER_METHODS",
    "E2ECase",
    "E2EProduction",
    "E2EReferee",
    "E2EResult",
    "E2ERunner",
    "E2ETargetRunner",
    "FixtureModel",
    "GeneratedTokens",
    "fixtures_dir",
    "moe_unsupported_reason",
]


class E2ERunner:
    """Both halves of a case in this process: the referee and the target's side, each with its own
    fixtures, built once and reused.

    The dense model is loaded up front by the referee (so missing fixtures show at once), the others by
    their first case.
    """

    def __init__(self, target, fixtures: Path | None = None) -> None:
        self.target = target
        self.referee = E2EReferee(fixtures)
        self.fixtures = self.referee.fixtures
        self.producer = E2ETargetRunner(target, self.fixtures)
        self.tokenizer = self.referee.tokenizer

    def model(self, name: str) -> FixtureModel:
        """A fixture model with its adapters and reference (the referee's, loaded once)."""
        return self.referee.model(name)

    def decode(self, ids: list[int]) -> str:
        return self.referee.decode(ids)

    def unsupported_reason(self, case: E2ECase) -> str | None:
        return self.producer.unsupported_reason(case)

    def engine(self, model: str, dtype: str):
        """The target's engine for a model and dtype (the target's side's, started for a case)."""
        return self.producer.engine(model, dtype)

    def reference_generations(self, case: E2ECase) -> list[Generation]:
        """The float64 reference's greedy generations of the case's batch (computed once per batch)."""
        return self.referee.reference_generations(case)

    def produce(self, case: E2ECase, runs: int = 1) -> E2EProduction:
        """The target's production of the case, teacher-forced on the referee's continuations (the reference
        runs only for a case the target supports)."""
        continuations = None if self.producer.unsupported_reason(case) else self.referee.continuations(case)
        return self.producer.produce(case, continuations, runs)

    def run(self, case: E2ECase, runs: int = 1) -> E2EResult:
        """The case's result: produced by the target's side, judged by the referee (``runs`` > 1: the
        production repeated, its determinism on the result)."""
        return self.referee.judge(case, self.produce(case, runs))
