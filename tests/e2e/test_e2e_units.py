"""Units of the end-to-end layer: fixture parsing errors, the comparison rules, the case data.

The rules are checked on hand-made generations, so each boundary (near-tie, log-prob bound, length)
is seen on both sides.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conformance.e2e.adapters import Adapter
from conformance.e2e.cases import BATCHES, E2E_CASES, MODEL_ADAPTERS, E2ECase, e2e_cases
from conformance.e2e.checkpoint import Checkpoint, ModelConfig
from conformance.e2e.compare import GENERATION_TOLERANCES, Comparison
from conformance.e2e.generation import Generation, Request, Step, slot_assignment
from conformance.e2e.lora_stacks import LoRAStacks
from conformance.e2e.run import fixtures_dir

FIXTURES = fixtures_dir()
MODEL = FIXTURES / "tiny-llama"
ADAPTER = FIXTURES / "adapters" / "attn-qv-r8"
MOE_MODEL = FIXTURES / "tiny-mixtral"
MOE_ADAPTER = FIXTURES / "moe-adapters" / "moe-experts-attn-r8-rslora"
COHERE_MODEL = FIXTURES / "tiny-cohere"


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return Checkpoint.load(MODEL).config


@pytest.fixture(scope="module")
def moe() -> Checkpoint:
    return Checkpoint.load(MOE_MODEL)


def copy_adapter(tmp_path: Path, source: Path = ADAPTER) -> Path:
    target = tmp_path / "adapter"
    shutil.copytree(source, target)
    return target


def edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    raw = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    file.write_text(json.dumps(raw))


# -- fixtures: bad input names the field ---------------------------------------------------------

def test_fixture_adapters_load_with_their_declared_modules(config):
    adapter = Adapter.load(ADAPTER, config)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert {module for _, module in adapter.deltas} == {"q_proj", "v_proj"}
    rslora = Adapter.load(FIXTURES / "adapters" / "all-linear-r16-rslora", config)
    assert rslora.scaling == pytest.approx(32 / 4)  # alpha / sqrt(r)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": None}, "missing field 'r'"),
        ({"r": 0}, "field 'r' must be a positive integer"),
        ({"peft_type": "IA3"}, "field 'peft_type' must be 'LORA'"),
        ({"use_dora": True}, "field 'use_dora'"),
        ({"target_modules": ["q_proj", "mystery_proj"]}, "field 'target_modules' names ['mystery_proj']"),
        ({"target_modules": ["q_proj"]}, "which target_modules does not list"),
        ({"r": 4}, "r=4 and the model imply"),
    ],
)
def test_malformed_adapter_config_names_the_field(tmp_path, config, changes, message):
    path = copy_adapter(tmp_path)
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=None) as error:
        Adapter.load(path, config)
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_fixture_moe_adapters_unpack_peft_expert_layout(moe):
    """PEFT's ParamWrapper pair [E·r, in] / [out, r·E] per expert: A rows expert-major, B columns rank-major."""
    adapter = Adapter.load(MOE_ADAPTER, moe.config)
    assert adapter.rank == 8 and adapter.scaling == pytest.approx(16 / 8**0.5)
    assert adapter.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"}
    raw = load_file(MOE_ADAPTER / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.mlp.experts."
    gate_up, down = adapter.delta(1, "experts.gate_up_proj"), adapter.delta(1, "experts.down_proj")
    assert gate_up.a.shape == (6, 8, 64) and gate_up.b.shape == (6, 64, 8)  # 2·I = 64 gate/up rows
    assert down.a.shape == (6, 8, 32) and down.b.shape == (6, 64, 8)
    expert, j = 4, 3
    assert torch.equal(gate_up.a[expert, j], raw[prefix + "base_layer.lora_A.weight"][expert * 8 + j])
    assert torch.equal(gate_up.b[expert, :, j], raw[prefix + "base_layer.lora_B.weight"][:, j * 6 + expert])
    assert torch.equal(down.b[expert, :, j], raw[prefix + "lora_B.weight"][:, j * 6 + expert])
    attention_only = Adapter.load(FIXTURES / "moe-adapters" / "moe-attn-qv-r6", moe.config)
    assert {module for _, module in attention_only.deltas} == {"q_proj", "v_proj"}


def test_moe_stacks_fold_the_scaling_and_enable_only_expert_adapters(moe):
    adapters = {p.name: Adapter.load(p, moe.config) for p in sorted((FIXTURES / "moe-adapters").iterdir())}
    slots = (adapters["moe-attn-qv-r6"], adapters["moe-experts-r4"], None, adapters["moe-experts-attn-r8-rslora"])
    stacks = LoRAStacks.build(slots, moe.config, torch.float64, "cpu")
    site = stacks.experts[0]
    assert site.adapter_enabled.dtype == torch.int32 and site.adapter_enabled.tolist() == [0, 1, 0, 1, 0]
    assert site.w13_lora_a[0].shape == (4, 6, 8, 64) and site.w13_lora_b[0].shape == (4, 6, 64, 8)
    assert site.w2_lora_a[0].shape == (4, 6, 8, 32) and site.w2_lora_b[0].shape == (4, 6, 64, 8)
    r4 = adapters["moe-experts-r4"].delta(0, "experts.down_proj")
    torch.testing.assert_close(site.w2_lora_b[0][1, :, :, :4], r4.b.double() * 2.0)  # alpha 8 / r 4
    assert not site.w2_lora_b[0][1, :, :, 4:].any() and not site.w13_lora_a[0][0].any() and not site.w13_lora_a[0][2].any()
    assert set(stacks.layers[0]) == {"qkv_proj", "o_proj"}  # a Mixtral has no dense MLP call sites


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.router"]}, "field 'target_parameters' names 'mlp.experts.router'"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters names 1 expert parameter(s)"),
        ({"target_modules": ["q_proj", "gate_proj"]}, "field 'target_modules' names ['gate_proj']"),
        ({"r": 4}, "r=4 and 6 experts imply"),
    ],
)
def test_malformed_moe_adapter_names_the_field(tmp_path, moe, changes, message):
    path = copy_adapter(tmp_path, MOE_ADAPTER)
    edit_config(path, **changes)
    with pytest.raises(ValueError) as error:
        Adapter.load(path, moe.config)
    assert message in str(error.value) and str(path) in str(error.value)


def test_expert_parameters_are_named_by_dotted_suffix_as_peft_matches_them(tmp_path, moe):
    path = copy_adapter(tmp_path, MOE_ADAPTER)
    edit_config(path, target_parameters=["experts.down_proj", "gate_up_proj"])
    assert Adapter.load(path, moe.config).deltas.keys() == Adapter.load(MOE_ADAPTER, moe.config).deltas.keys()


def test_a_moe_adapter_missing_a_half_or_on_the_dense_model_is_refused(tmp_path, config, moe):
    path = copy_adapter(tmp_path, MOE_ADAPTER)
    with pytest.raises(ValueError, match="field 'target_parameters'.*the model has no experts"):
        Adapter.load(path, config)
    tensors = load_file(path / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"expert parameter 'down_proj' \(layer 1\) has lora_A, not both"):
        Adapter.load(path, moe.config)


def test_moe_checkpoint_fuses_the_experts_as_transformers_does(tmp_path, moe):
    raw = load_file(MOE_MODEL / "model.safetensors")
    gate_up = moe.weights["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (6, 64, 64) and moe.config.experts.num_experts == 6 and moe.config.experts.top_k == 2
    assert torch.equal(gate_up[5, :32], raw["model.layers.1.block_sparse_moe.experts.5.w1.weight"])  # gate rows first
    assert torch.equal(gate_up[5, 32:], raw["model.layers.1.block_sparse_moe.experts.5.w3.weight"])
    assert torch.equal(moe.weights["model.layers.1.mlp.experts.down_proj"][5], raw["model.layers.1.block_sparse_moe.experts.5.w2.weight"])
    shutil.copytree(MOE_MODEL, tmp_path / "m")
    del raw["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(raw, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.block_sparse_moe.experts.3.w2.weight'"):
        Checkpoint.load(tmp_path / "m")
    file = tmp_path / "m" / "config.json"
    settings = json.loads(file.read_text())
    file.write_text(json.dumps({**settings, "num_experts_per_tok": 7}))
    with pytest.raises(ValueError, match="field 'num_experts_per_tok' is 7"):
        Checkpoint.load(tmp_path / "m")
    file.write_text(json.dumps({**settings, "sliding_window": 16}))
    with pytest.raises(ValueError, match="field 'sliding_window'"):
        Checkpoint.load(tmp_path / "m")


def test_cohere_checkpoint_reads_its_parallel_block_and_ties_the_lm_head(tmp_path):
    cohere = Checkpoint.load(COHERE_MODEL)
    c = cohere.config
    assert c.parallel is not None and c.parallel.logit_scale == 12.5 and c.norm_eps == 1e-5 and c.experts is None
    assert "lm_head.weight" not in load_file(COHERE_MODEL / "model.safetensors")  # tied: saved without it
    assert cohere.weights["lm_head.weight"] is cohere.weights["model.embed_tokens.weight"]
    assert "model.layers.0.post_attention_layernorm.weight" not in cohere.weights  # one norm per layer
    shutil.copytree(COHERE_MODEL, tmp_path / "m")
    file = tmp_path / "m" / "config.json"
    settings = json.loads(file.read_text())
    for changes, message in [({"use_qk_norm": True}, "field 'use_qk_norm'"), ({"tie_word_embeddings": False}, "field 'tie_word_embeddings'"),
                             ({"rms_norm_eps": 1e-6}, "field 'rms_norm_eps'"), ({"logit_scale": None}, "missing field 'logit_scale'"),
                             ({"layer_norm_eps": None}, "missing field 'layer_norm_eps'")]:
        file.write_text(json.dumps({k: v for k, v in (settings | changes).items() if v is not None}))
        with pytest.raises(ValueError, match=message):
            Checkpoint.load(tmp_path / "m")


def test_pickled_adapter_weights_are_refused(tmp_path, config):
    path = copy_adapter(tmp_path)
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(ValueError, match="only adapter_model.safetensors is read"):
        Adapter.load(path, config)


def test_truncated_safetensors_is_a_clear_error(tmp_path, config):
    path = copy_adapter(tmp_path)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        Adapter.load(path, config)


def test_model_config_with_unsupported_architecture_is_refused(tmp_path):
    shutil.copytree(MODEL, tmp_path / "m")
    file = tmp_path / "m" / "config.json"
    raw = json.loads(file.read_text())
    file.write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="field 'tie_word_embeddings'"):
        Checkpoint.load(tmp_path / "m")
    file.write_text(json.dumps({k: v for k, v in raw.items() if k != "num_key_value_heads"}))
    with pytest.raises(ValueError, match="missing field 'num_key_value_heads'"):
        Checkpoint.load(tmp_path / "m")


# -- the comparison rules ------------------------------------------------------------------------

def step(token: int, logprob: float, runner_up: int, runner_up_logprob: float) -> Step:
    top = ((token, logprob), (runner_up, runner_up_logprob))
    return Step(token, logprob, tuple(sorted(top, key=lambda t: -t[1])))


def generation(*steps: Step, adapter: str | None = None) -> Generation:
    return Generation(Request("p", adapter), (0, 5), steps)


COMPARE = Comparison("bfloat16", decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))
TOL = GENERATION_TOLERANCES["bfloat16"]


def test_greedy_divergence_at_a_near_tie_is_accepted_and_beyond_it_is_not():
    reference = generation(step(1, -0.1, 2, -3.0), step(3, -0.6, 4, -0.6 - TOL.near_tie / 2))
    tied = generation(step(1, -0.1, 2, -3.0), step(4, -0.6, 3, -0.7))
    assert COMPARE.greedy(0, tied, reference) == []
    clear = generation(step(2, -0.1, 1, -3.0), step(3, -0.6, 4, -0.7))
    problems = COMPARE.greedy(0, clear, reference)
    assert len(problems) == 1 and "diverges from the reference at step 0" in problems[0].message
    assert "[2, 3]" in problems[0].message and "[1, 3]" in problems[0].message  # both continuations, ids


def test_teacher_forced_log_prob_bound_is_inclusive():
    reference = generation(step(1, -1.0, 2, -3.0))
    at_bound = generation(step(1, -1.0 - TOL.logprob_error, 2, -3.0))
    past_bound = generation(step(1, -1.0 - 2 * TOL.logprob_error, 2, -3.0))
    assert COMPARE.scores(0, at_bound, reference) == []
    assert "error" in COMPARE.scores(0, past_bound, reference)[0].message


def test_teacher_forced_top1_flip_counts_only_outside_near_ties():
    reference = generation(step(1, -0.5, 2, -0.5 - 2 * TOL.near_tie))
    flipped = generation(step(1, -0.9, 2, -0.6))  # top-1 is now 2; log p(1) within the bound
    assert "top-1" in COMPARE.scores(0, flipped, reference)[0].message
    near = generation(step(1, -0.5, 2, -0.5 - TOL.near_tie / 2))
    assert COMPARE.scores(0, generation(step(1, -0.6, 2, -0.55)), near) == []


def test_a_missing_position_is_a_problem_not_an_exception():
    reference = generation(step(1, -0.1, 2, -3.0), step(1, -0.1, 2, -3.0))
    short = generation(step(1, -0.1, 2, -3.0))
    assert "returned 1 positions, expected 2" in COMPARE.greedy(0, short, reference)[0].message
    assert "returned 1 positions, expected 2" in COMPARE.scores(0, short, reference)[0].message


def test_invariance_uses_the_smaller_margin_of_the_two_runs():
    here = generation(step(1, -0.1, 2, -0.1 - TOL.near_tie / 2))
    there = generation(step(2, -0.1, 1, -3.0))
    assert COMPARE.greedy(0, here, there, against="the same request alone") == []
    assert COMPARE.greedy(0, here, there, against="the reference") != []  # only the reference's margin counts


def routed(step_: Step, routing_margin: float) -> Step:
    return Step(step_.token, step_.logprob, step_.top, routing_margin)


def test_a_routing_near_tie_excuses_its_position_and_ends_greedy():
    tie = TOL.router_near_tie
    reference = generation(step(1, -0.1, 2, -3.0), routed(step(3, -0.2, 4, -3.0), tie), step(5, -0.1, 6, -3.0))
    wrong_there = generation(step(1, -0.1, 2, -3.0), step(4, -0.2, 3, -3.0), step(5, -0.1, 6, -3.0))
    assert COMPARE.scores(0, wrong_there, reference) == []  # the expert choice there may differ
    assert COMPARE.greedy(0, wrong_there, reference) == []
    clear = generation(step(1, -0.1, 2, -3.0), routed(step(3, -0.2, 4, -3.0), 2 * tie), step(5, -0.1, 6, -3.0))
    assert COMPARE.scores(0, wrong_there, clear) and COMPARE.greedy(0, wrong_there, clear)
    early = generation(step(2, -0.1, 1, -3.0), step(3, -0.2, 4, -3.0), step(5, -0.1, 6, -3.0))
    assert COMPARE.greedy(0, early, reference)  # a divergence before the routing near-tie still fails
    assert COMPARE.max_logprob_error([wrong_there], [reference]) == 0.0  # the excused position is not measured


def test_step_from_logits_takes_argmax_and_log_softmax():
    logits = torch.tensor([0.0, 2.0, 1.0])
    taken = Step.from_logits(logits, None, top_k=2)
    assert taken.token == 1
    assert taken.logprob == pytest.approx(float(torch.log_softmax(logits.double(), -1)[1]))
    assert taken.margin == pytest.approx(1.0)


# -- slots and cases -----------------------------------------------------------------------------

def test_slots_follow_first_use_and_empty_slots_trail():
    requests = [Request("a", "x"), Request("b", None), Request("c", "y"), Request("d", "x")]
    slots, per_request = slot_assignment(requests, 3)
    assert slots == ("x", "y", None) and per_request == [0, -1, 1, 0]
    with pytest.raises(ValueError, match="uses 2 adapters but only 1 slots"):
        slot_assignment(requests, 1)


def test_every_batch_names_its_models_fixture_adapters_and_fits_its_slots():
    for name, batch in BATCHES.items():
        names = {p.name for p in (FIXTURES / MODEL_ADAPTERS[batch.model]).iterdir()}
        used = {adapter for _, adapter in batch.requests if adapter}
        assert used <= names, name
        assert len(used) in (0, batch.max_loras), name  # no slot left empty by a batch that uses adapters: cases.py


def test_the_moe_batches_run_the_moe_model_as_their_own_ops():
    moe = [case for case in E2E_CASES if case.is_moe]
    assert {case.batch for case in moe} == {"moe-mixed", "moe-one-slot", "moe-fp8-mixed"}
    assert {case.op for case in moe} == {"moe_teacher_forced_logits", "moe_greedy_generation", "moe_batch_invariance",
                                         "moe_order_invariance"}
    assert {"neg1", "last_slot"} <= E2ECase("greedy_generation", "moe-mixed", "float32", True).features()


def test_the_mixed_batch_exposes_the_no_adapter_corner():
    case = E2ECase("greedy_generation", "mixed", "float32", True)
    assert {"neg1", "last_slot"} <= case.features()
    assert "allneg1" in E2ECase("greedy_generation", "base-only", "float32", False).features()


def test_smoke_is_a_subset_and_standard_has_every_kind_and_dtype():
    smoke, standard = e2e_cases("smoke"), e2e_cases("standard")
    assert set(smoke) < set(standard) == set(E2E_CASES)
    assert {c.kind for c in standard} == {"teacher_forced_logits", "greedy_generation", "batch_invariance", "order_invariance",
                                          "token_classification"}
    assert {c.dtype for c in standard} == {"float32", "bfloat16", "float16"}
    # dense 36 + MoE 18 + fp8 MoE 4 (no float16) + packed5 12 + token classifier 3; smoke dense 5 + MoE 2 + fp8 MoE 1 + packed5 2
    assert (len(standard), len(smoke)) == (73, 10)
    assert {c.dtype for c in standard if c.batch == "moe-fp8-mixed"} == {"float32", "bfloat16"}
    with pytest.raises(ValueError, match="fp8 model 'tiny-mixtral-fp8' in float16"):
        E2ECase("greedy_generation", "moe-fp8-mixed", "float16", False)
    assert len({c.case_id for c in standard}) == len(standard)


def test_an_infinite_logprob_error_is_written_as_valid_json():
    """A token the target gave no probability makes the error infinite: results.json must stay JSON (no Infinity)."""
    import json
    import math

    from conformance.e2e.cases import e2e_cases
    from conformance.e2e.referee import E2EResult
    from conformance.verdict import Outcome
    from conformance.verdict.judge import number_from_json

    case = e2e_cases("smoke")[0]
    record = E2EResult(case.case_id, case, Outcome.FAIL, "a token with no probability", max_logprob_error=math.inf).to_json()
    text = json.dumps(record, allow_nan=False)  # raises on a non-finite float
    assert json.loads(text)["measurement"] == {"max_logprob_error": "inf", "budget_ratio": "inf"}
    assert number_from_json("inf") == math.inf and number_from_json("nan") is None and number_from_json(0.5) == 0.5
