"""End-to-end generation equivalence (design level 4): does a mixed-adapter batch generate what it must?

One idea per module:

* ``checkpoint`` / ``adapters``: the fixture models (a dense Llama, a Mixtral MoE, a Cohere with a parallel
  block, a Llama token classifier) and their PEFT adapters (on the Mixtral also on its fused experts; per-module
  ranks and alphas; saved classification heads), read from safetensors;
* ``lora_stacks``: adapters placed in slots, as the stacked weights of each LoRA call site;
* ``decoder``: the suite's small Llama-style decoder (dense MLP, top-k routed experts, or a parallel block
  whose q/k/v/gate/up are one call of 5 slices), every LoRA delta through a target's wrapper methods
  (``add_lora_w13``/``add_lora_w2`` for the experts, ``add_shrink`` for a token classifier's saved heads);
* ``generation``: requests, steps and generations, the vocabulary every engine returns;
* ``decoder_engine`` / ``vllm_engine``: greedy decoding and teacher-forced scoring, by the suite's
  decoder on a target, or by the installed vLLM's ``LLM(enable_lora=True)``;
* ``compare``: the rules (near-ties, log-prob bounds per dtype);
* ``cases``: the end-to-end cases as data;
* ``production``: what the target's side hands the referee (plain, picklable data), and which batches
  a case runs;
* ``target_runner``: the target's side of a case, everything that runs the target's code (its engine);
* ``referee``: the referee's side, the float64 reference and the judgement, importing no target;
* ``run``: both sides composed in one process, running one case on one target and judging it.

The names below load on first use, so that importing the referee loads nothing of the target's side.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "E2ECase": "cases",
    "E2E_CASES": "cases",
    "e2e_cases": "cases",
    "E2EProduction": "production",
    "E2EReferee": "referee",
    "E2EResult": "referee",
    "E2ETargetRunner": "target_runner",
    "E2ERunner": "run",
}

__all__ = ["E2ECase", "E2EProduction", "E2EReferee", "E2EResult", "E2ERunner", "E2ETargetRunner", "E2E_CASES", "e2e_cases"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
