"""End-to-end generation equivalence (design level 4): does a mixed-adapter batch generate what it must?

One idea per module:

* ``checkpoint`` / ``adapters``: the fixture models (a dense Llama, a Mixtral MoE, a Cohere with a parallel
  block) and their PEFT adapters (on the Mixtral also on its fused experts), read from safetensors;
* ``lora_stacks``: adapters placed in slots, as the stacked weights of each LoRA call site;
* ``decoder``: the suite's small Llama-style decoder (dense MLP, top-k routed experts, or a parallel block
  whose q/k/v/gate/up are one call of 5 slices), every LoRA delta through a target's wrapper methods
  (``add_lora_w13``/``add_lora_w2`` for the experts);
* ``generation``: requests, steps and generations, the vocabulary every engine returns;
* ``decoder_engine`` / ``vllm_engine``: greedy decoding and teacher-forced scoring, by the suite's
  decoder on a target, or by the installed vLLM's ``LLM(enable_lora=True)``;
* ``compare``: the rules (near-ties, log-prob bounds per dtype);
* ``cases``: the end-to-end cases as data;
* ``run``: running one case on one target and judging it against the float64 reference.
"""

from .cases import E2E_CASES, E2ECase, e2e_cases
from .run import E2EResult, E2ERunner

__all__ = ["E2ECase", "E2E_CASES", "E2EResult", "E2ERunner", "e2e_cases"]
