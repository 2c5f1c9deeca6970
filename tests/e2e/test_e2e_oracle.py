"""The suite's decoder, run on the golden reference, against an independent oracle: transformers + PEFT.

Before any target is compared with the reference end to end, the reference itself must be right:
for the base model and every fixture adapter, the decoder's log-probabilities match PEFT's (each
request run alone, the adapter applied by PEFT's own LoRA layers), and so does a mixed batch in which
every request has its own adapter or none (the decoder packs it; PEFT runs each request by itself).

Every fixture model: the dense Llama, the Mixtral whose adapters put LoRA on its fused experts (PEFT's
``target_parameters``), which the decoder runs through ``add_lora_w13``/``add_lora_w2``, and the Cohere
(``CohereForCausalLM``: parallel block, LayerNorm, interleaved rotary, tied lm_head, ``logit_scale``),
whose q/k/v/gate/up the decoder runs as one ``add_lora_linear`` call of 5 slices.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.e2e.cases import (
    ADAPTERS,
    DENSE_MODEL,
    EXPERTS,
    EXPERTS_ATTN,
    FIVE,
    FP8_MOE_MODEL,
    GATE_UP,
    K_UP,
    MOE_ADAPTERS,
    MOE_ATTN,
    MOE_MODEL,
    PARALLEL_ADAPTERS,
    PARALLEL_MODEL,
    PATTERN_ADAPTERS,
    PATTERNS,
    PATTERNS_RSLORA,
    PROMPTS,
)
from conformance.e2e.decoder_engine import DecoderEngine
from conformance.e2e.generation import Request
from conformance.e2e.run import E2ERunner, FixtureModel
from conformance.targets.reference import ReferenceTarget

FP8_MOE_ADAPTERS = (EXPERTS, EXPERTS_ATTN)  # fixtures/moe-fp8-adapters
transformers = pytest.importorskip("transformers", reason="the oracle needs the e2e extra (transformers, peft)")
peft = pytest.importorskip("peft", reason="the oracle needs the e2e extra (transformers, peft)")

NEW_TOKENS = 12
MIXED = {  # a batch per model: every adapter, and base requests
    DENSE_MODEL: ([None, "attn-qv-r8", None, "all-linear-r16-rslora", "mlp-r6", "embed-head-r8"], 4),
    MOE_MODEL: ([None, EXPERTS, MOE_ATTN, None, EXPERTS_ATTN, EXPERTS], 3),
    PARALLEL_MODEL: ([K_UP, None, FIVE, GATE_UP, None, FIVE], 3),
}
MODELS = [DENSE_MODEL, MOE_MODEL, PARALLEL_MODEL]
# the adapters with per-module ranks and alphas (rank_pattern / alpha_pattern) beside a plain one, on the Llama
PATTERNS_MIXED = ([PATTERNS, None, "attn-qv-r8", PATTERNS_RSLORA, None, PATTERNS], 3)


@pytest.fixture(scope="module")
def runner() -> E2ERunner:
    return E2ERunner(ReferenceTarget())


def peft_logprobs(fixture: FixtureModel, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position, by transformers (+ PEFT for an adapter), float64.

    The experts run transformers' eager loop (its default grouped_mm takes no float64).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            fixture.checkpoint.path, dtype=torch.float64, experts_implementation="eager")
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, fixture.adapter_dirs[adapter])
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


@pytest.mark.parametrize(("model", "adapter"), [(model, a) for model, adapters in
                                               ((DENSE_MODEL, ADAPTERS + PATTERN_ADAPTERS), (MOE_MODEL, MOE_ADAPTERS),
                                                (PARALLEL_MODEL, PARALLEL_ADAPTERS))
                                               for a in (None, *adapters)])
def test_decoder_matches_peft_for_base_and_every_adapter(runner, model, adapter):
    fixture = runner.model(model)
    requests = [Request(prompt, adapter) for prompt in PROMPTS[:3]]
    generations = fixture.reference.generate(requests, NEW_TOKENS, 5, max_loras=1)
    for generation in generations:
        ids = list(generation.prompt_ids) + list(generation.tokens)
        oracle = peft_logprobs(fixture, adapter, ids)
        start = len(generation.prompt_ids) - 1
        for step, taken in enumerate(generation.steps):
            row = oracle[start + step]
            # transformers computes the rotary tables (and a Mixtral its router softmax, a Cohere its
            # LayerNorms and rotation) in float32 even for a float64 model: ~1e-6 apart
            assert abs(row[taken.token].item() - taken.logprob) < 1e-4, (adapter, generation.request.prompt, step)
            # greedy: PEFT's argmax is the decoder's token wherever PEFT's top-2 margin is not a tie
            top2 = row.topk(2).values
            if top2[0] - top2[1] > 1e-3:
                assert int(row.argmax()) == taken.token, (adapter, generation.request.prompt, step)


@pytest.mark.parametrize(("model", "batch"), [*((model, MIXED[model]) for model in MODELS), (DENSE_MODEL, PATTERNS_MIXED)],
                         ids=[*MODELS, "patterns"])
def test_mixed_batch_matches_peft_per_request(runner, model, batch):
    fixture, (names, max_loras) = runner.model(model), batch
    requests = [Request(prompt, name) for prompt, name in zip(PROMPTS, names)]
    batch = fixture.reference.generate(requests, NEW_TOKENS, 5, max_loras=max_loras)
    for generation in batch:
        ids = list(generation.prompt_ids) + list(generation.tokens)
        oracle = peft_logprobs(fixture, generation.request.adapter, ids)
        start = len(generation.prompt_ids) - 1
        got = torch.tensor([step.logprob for step in generation.steps], dtype=torch.float64)
        want = oracle[start : start + len(generation.steps)].gather(1, torch.tensor(generation.tokens)[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_every_adapter_changes_the_output(runner, model):
    """Otherwise a target that drops an adapter (or hands base requests one) could pass unseen."""
    fixture, prompt = runner.model(model), PROMPTS[0]
    outputs = {name: fixture.reference.generate([Request(prompt, name)], NEW_TOKENS, 5, 1)[0].tokens
               for name in [None, *fixture.adapters]}
    assert len(set(outputs.values())) == len(outputs), outputs


@pytest.mark.parametrize("model", MODELS)
def test_float32_decoder_is_within_the_float32_tolerance_of_float64(runner, model):
    fixture, (names, max_loras) = runner.model(model), MIXED[model]
    engine = DecoderEngine(ReferenceTarget(), fixture.checkpoint, fixture.adapters, torch.float32)
    requests = [Request(p, n) for p, n in zip(PROMPTS, names)]
    reference = fixture.reference.generate(requests, NEW_TOKENS, 5, max_loras=max_loras)
    scored = engine.score(requests, [g.tokens for g in reference], 5, max_loras=max_loras)
    worst = max(abs(a.logprob - b.logprob) for g, r in zip(scored, reference) for a, b in zip(g.steps, r.steps))
    assert worst < 1e-4


def dequantized_peft_logprobs(fixture: FixtureModel, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """PEFT on the fp8 MoE model: transformers' Mixtral made from the config without its quantization_config and
    given the checkpoint's weights as the suite dequantizes them (transformers' fp8 loader needs a GPU)."""
    config = transformers.AutoConfig.from_pretrained(fixture.checkpoint.path)
    del config.quantization_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
        model.load_state_dict({name: t.double() for name, t in fixture.checkpoint.weights.items()}, strict=True)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, fixture.adapter_dirs[adapter])
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


@pytest.mark.parametrize("adapter", [None, *FP8_MOE_ADAPTERS])
def test_fp8_moe_decoder_matches_peft_on_the_dequantized_weights(runner, adapter):
    """The fp8 MoE model's weights as vLLM dequantizes them, and its LoRA, against PEFT. PEFT cannot run the
    activation quantization: its ParamWrapper merges the expert LoRA into the weight, so its LoRA would read the
    quantized activations, which vLLM's LoRA does not (conformance.e2e.fp8). So the oracle compares the decoder
    with activation quantization off (measured: within 1.9e-6 of PEFT), and the decoder with it on must differ from
    that (measured: up to 0.96 in a scored log-probability, where a rounded activation moves a later layer's router)."""
    fixture = runner.model(FP8_MOE_MODEL)
    requests = [Request(prompt, adapter) for prompt in PROMPTS[:3]]
    decoder = fixture.reference.decoder
    quantized = fixture.reference.generate(requests, NEW_TOKENS, 5, max_loras=1)
    decoder.quantize_activations = False
    try:
        exact = fixture.reference.score(requests, [g.tokens for g in quantized], 5, max_loras=1)
    finally:
        decoder.quantize_activations = True
    noise = 0.0
    for generation, fed in zip(exact, quantized):
        oracle = peft_logprobs_at(dequantized_peft_logprobs(fixture, adapter, list(generation.prompt_ids) + list(generation.tokens)),
                                  generation)
        got = torch.tensor([step.logprob for step in generation.steps], dtype=torch.float64)
        torch.testing.assert_close(got, oracle, atol=1e-4, rtol=0)
        noise = max(noise, max(abs(a.logprob - b.logprob) for a, b in zip(generation.steps, fed.steps)))
    assert noise > 1e-6, noise  # the fp8 activations are in effect


def peft_logprobs_at(oracle: torch.Tensor, generation) -> torch.Tensor:
    """The oracle's log-probabilities of a generation's tokens, position by position."""
    start = len(generation.prompt_ids) - 1
    return oracle[start : start + len(generation.steps)].gather(1, torch.tensor(generation.tokens)[:, None])[:, 0]
