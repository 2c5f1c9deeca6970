"""Running one end-to-end case on one target and judging it, like ``conformance.runner`` for op cases.

The reference is the suite's decoder on the golden reference target in float64 (itself checked against
transformers + PEFT in tests/e2e/test_e2e_oracle.py). A target runs either the suite's decoder through its
wrapper methods (``generation_engine = "decoder"``) or the installed vLLM engine on its device
(``generation_engine = "vllm"``: the ``cpu``, ``cuda`` and ``vllm-hpu`` targets).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.ops import Level
from conformance.runner import CaseResult
from conformance.verdict import FailureKind, Outcome
from conformance.verdict.failure_kind import ordered

from .adapters import Adapter
from .cases import MAX_NEW_TOKENS, TOP_K, E2ECase
from .checkpoint import Checkpoint
from .compare import GENERATION_TOLERANCES, Comparison, Problem
from .decoder_engine import DecoderEngine
from .generation import Generation, slot_assignment

FIXTURES_ENV = "LORA_CONFORMANCE_FIXTURES"
WRAPPER_METHODS = ("add_lora_linear", "add_lora_embedding", "add_lora_logits")


def fixtures_dir() -> Path:
    """``$LORA_CONFORMANCE_FIXTURES`` or the fixtures shipped in the package (``conformance/fixtures/``)."""
    return Path(os.environ.get(FIXTURES_ENV) or Path(__file__).resolve().parents[1] / "fixtures")


@dataclass
class E2EResult(CaseResult):
    """One end-to-end case's result: an op case's record, at level "model", measured in log-probs.

    ``failing_slots`` are the slots of the failing requests (−1 = a base request), so expectations'
    ``failing_rows = "no-adapter"`` reads them as it reads an op case's rows.
    """

    case: E2ECase
    max_logprob_error: float | None = None  # against the reference (invariance: between the two runs)

    @property
    def level(self) -> Level:
        return Level.MODEL

    def measurement_json(self) -> dict | None:
        """The largest log-prob error and its ratio to the dtype's bound (the report's budget ratio)."""
        if self.max_logprob_error is None:
            return None
        bound = GENERATION_TOLERANCES[self.case.dtype].logprob_error
        return {"max_logprob_error": self.max_logprob_error, "budget_ratio": self.max_logprob_error / bound}


class E2ERunner:
    """Per process: the fixtures, the reference engine and the target's engines (built once, reused)."""

    def __init__(self, target, fixtures: Path | None = None) -> None:
        self.target = target
        self.fixtures = fixtures or fixtures_dir()
        model_dir = self.fixtures / "tiny-llama"
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"end-to-end fixtures not found at {model_dir}: run `python conformance/fixtures/make_fixtures.py` in the "
                f"repository, or point ${FIXTURES_ENV} at a fixtures directory"
            )
        self.checkpoint = Checkpoint.load(model_dir)
        self.adapter_dirs = {p.name: p for p in sorted((self.fixtures / "adapters").iterdir()) if p.is_dir()}
        self.adapters = {
            name: Adapter.load(path, self.checkpoint.config, self.checkpoint.weights) for name, path in self.adapter_dirs.items()
        }
        self.tokenizer = self.checkpoint.tokenizer()
        from conformance.targets.reference import ReferenceTarget

        self.reference = DecoderEngine(ReferenceTarget(), self.checkpoint, self.adapters, torch.float64)
        self._engines: dict[str, object] = {}
        self._references: dict[str, list[Generation]] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def unsupported_reason(self, case: E2ECase) -> str | None:
        dtype = getattr(torch, case.dtype)
        if dtype not in self.target.dtypes:
            return f"{self.target.name} does not support {case.dtype}"
        if self.target.generation_engine == "vllm":
            return None
        missing = [m for m in WRAPPER_METHODS if not callable(getattr(self.target, m, None))]
        if missing:
            return f"{self.target.name} does not implement {', '.join(missing)} (the decoder needs every LoRA call site)"
        return None

    def engine(self, dtype: str):
        """The target's engine for a dtype: the suite's decoder, or vLLM's (one alive at a time)."""
        if dtype not in self._engines:
            torch_dtype = getattr(torch, dtype)
            if self.target.generation_engine == "vllm":
                from .vllm_engine import VllmEngine

                for other in self._engines.values():  # each vLLM engine holds a KV cache: keep one
                    other.close()
                self._engines.clear()
                max_rank = max(a.rank for a in self.adapters.values())
                self._engines[dtype] = VllmEngine(self.checkpoint, self.adapter_dirs, torch_dtype, self.reference.encode, max_rank)
            else:
                self._engines[dtype] = DecoderEngine(self.target, self.checkpoint, self.adapters, torch_dtype)
        engine = self._engines[dtype]
        if hasattr(engine, "start_case"):
            engine.start_case()
        return engine

    def reference_generations(self, case: E2ECase) -> list[Generation]:
        """The float64 reference's greedy generations of the case's batch (computed once per batch)."""
        if case.batch not in self._references:
            self._references[case.batch] = self.reference.generate(case.requests, MAX_NEW_TOKENS, TOP_K, case.max_loras)
        return self._references[case.batch]

    def run(self, case: E2ECase) -> E2EResult:
        start = time.perf_counter()
        features = case.features()
        reason = self.unsupported_reason(case)
        if reason:
            return E2EResult(case.case_id, case, Outcome.NOT_SUPPORTED, reason, features=features)
        try:
            problems, max_error = self._check(case)
        except NotImplementedError as exc:  # as for op cases: the target declares what it does not do
            message = f"a LoRA call of the decoder raised NotImplementedError: {exc}"
            return E2EResult(case.case_id, case, Outcome.NOT_SUPPORTED, message, features=features)
        except Exception as exc:  # noqa: BLE001 - any exception from the target is the "broken" outcome
            message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
            return E2EResult(
                case.case_id, case, Outcome.BROKEN, message, features=features, seconds=time.perf_counter() - start,
                kinds=(FailureKind.RAISED,),
            )
        seconds = time.perf_counter() - start
        if not problems:
            return E2EResult(case.case_id, case, Outcome.PASS, features=features, seconds=seconds, max_logprob_error=max_error)
        _, slots = slot_assignment(case.requests, case.max_loras)
        failing = sorted({p.request_index for p in problems})
        problems = sorted(problems, key=lambda p: p.request_index)
        message = f"{len(failing)} of {len(case.requests)} requests fail\n" + "\n".join(p.message for p in problems)
        return E2EResult(
            case.case_id, case, Outcome.FAIL, message, features=features, seconds=seconds,
            failing_slots=tuple(slots[i] for i in failing), max_logprob_error=max_error,
            kinds=ordered(kind for p in problems for kind in p.kinds),
        )

    def _check(self, case: E2ECase) -> tuple[list[Problem], float | None]:
        engine, compare = self.engine(case.dtype), Comparison(case.dtype, self.decode)
        requests, reference = case.requests, self.reference_generations(case)
        continuations = [g.tokens for g in reference]

        def run(batch: list[int]) -> tuple[list[Generation], list[Generation]]:
            """Teacher-forced scores and greedy generations of the requests at these indices, as one batch."""
            chosen = [requests[i] for i in batch]
            scored = engine.score(chosen, [continuations[i] for i in batch], TOP_K, case.max_loras)
            return scored, engine.generate(chosen, MAX_NEW_TOKENS, TOP_K, case.max_loras)

        problems: list[Problem] = []
        if case.kind == "teacher_forced_logits":
            got = engine.score(requests, continuations, TOP_K, case.max_loras)
            for i, (mine, ref) in enumerate(zip(got, reference)):
                problems += compare.scores(i, mine, ref)
            return problems, _max_logprob_error(got, reference)
        if case.kind == "greedy_generation":
            got = engine.generate(requests, MAX_NEW_TOKENS, TOP_K, case.max_loras)
            for i, (mine, ref) in enumerate(zip(got, reference)):
                problems += compare.greedy(i, mine, ref)
            return problems, _max_logprob_error(got, reference, common_prefix=True)
        everyone = list(range(len(requests)))
        if case.kind == "batch_invariance":
            others = [("the same request alone", [i]) for i in everyone]
        elif case.kind == "order_invariance":
            others = [("the batch reversed", everyone[::-1]), ("the batch rotated by one", everyone[1:] + everyone[:1])]
        else:
            raise ValueError(f"unknown end-to-end check {case.kind!r}")
        scored, generated = run(everyone)
        worst = 0.0
        for against, batch in others:
            other_scored, other_generated = run(batch)
            for position, i in enumerate(batch):
                problems += compare.scores(i, scored[i], other_scored[position], against)
                problems += compare.greedy(i, generated[i], other_generated[position], against)
            worst = max(worst, _max_logprob_error(other_scored, [scored[i] for i in batch]))
        return problems, worst


def _max_logprob_error(got: list[Generation], reference: list[Generation], common_prefix: bool = False) -> float:
    """Largest |log p| difference over positions where both scored the same token (and, greedy, the same past)."""
    worst = 0.0
    for mine, ref in zip(got, reference):
        for a, b in zip(mine.steps, ref.steps):
            if a.token != b.token:
                if common_prefix:
                    break
                continue
            worst = max(worst, abs(a.logprob - b.logprob))
    return worst
