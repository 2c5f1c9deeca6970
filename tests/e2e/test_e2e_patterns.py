"""End to end with per-module ranks and alphas: PEFT's ``rank_pattern`` and ``alpha_pattern``.

Two dense fixture adapters give their modules different ranks and alphas (``patterns-r8``; and
``patterns-r6-rslora``, under rsLoRA, on the embedding and lm_head too). Each module's rank and scaling is
that of the first pattern key naming it, ``alpha_m / r_m`` (``alpha_m / √r_m`` under rsLoRA). The parser must
give every module what PEFT's own layers have (the oracle) and what vLLM's loader computes
(``PEFTHelper.get_rank_and_scaling``); the ``patterns-mixed`` cases (feature ``per_module_rank``) run them
beside a plain adapter and base requests; a loader that ignores the patterns fails them, and only for the
pattern adapters' requests.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
from fault_targets import PlainTorchTarget

from conformance.e2e.adapters import Adapter, RankRule
from conformance.e2e.cases import ATTN, BATCHES, DENSE_MODEL, E2E_CASES, PATTERN_ADAPTERS, PATTERNS, PATTERNS_RSLORA, E2ECase
from conformance.e2e.checkpoint import Checkpoint
from conformance.e2e.fixture_files import FixtureFiles, fixtures_dir
from conformance.e2e.generation import slot_assignment
from conformance.e2e.lora_stacks import LoRAStacks
from conformance.e2e.run import E2ERunner
from conformance.e2e.target_runner import E2ETargetRunner
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome

FIXTURES = fixtures_dir()
PATTERN_CASES = [case for case in E2E_CASES if case.batch == "patterns-mixed"]


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return Checkpoint.load(FIXTURES / DENSE_MODEL)


@pytest.fixture(scope="module")
def adapters(checkpoint) -> dict[str, Adapter]:
    return {name: Adapter.load(FIXTURES / "adapters" / name, checkpoint.config, checkpoint.weights) for name in PATTERN_ADAPTERS}


def module_path(layer: int | None, module: str) -> str:
    """The module's name in the model (what PEFT and vLLM match pattern keys against)."""
    if layer is None:
        return "lm_head" if module == "lm_head" else f"model.{module}"
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


# -- the fixtures and the rule --------------------------------------------------------------------

def test_the_pattern_adapters_give_modules_ranks_and_alphas_other_than_r_and_lora_alpha(adapters):
    for adapter in adapters.values():
        raw = json.loads((adapter.path / "adapter_config.json").read_text())
        assert raw["rank_pattern"] and raw["alpha_pattern"], adapter.name
        ranks = {delta.rank for delta in adapter.deltas.values()}
        scalings = {delta.scaling for delta in adapter.deltas.values()}
        assert adapter.rank in ranks and len(ranks) >= 3 and len(scalings) >= 4, (adapter.name, ranks, scalings)
        assert adapter.max_rank == max(ranks) > adapter.rank  # a module above r: the stacks must be that wide
    plain = adapters[PATTERNS]
    # the layer's own key sorts before "q_proj" in the file, so it decides layer 0; "q_proj" decides layer 1
    assert (plain.delta(0, "q_proj").rank, plain.delta(1, "q_proj").rank) == (4, 2)
    assert (plain.delta(0, "q_proj").scaling, plain.delta(1, "q_proj").scaling) == (16 / 4, 16 / 2)
    assert plain.delta(1, "o_proj").scaling == 4 / 8 and plain.delta(1, "down_proj").scaling == 6 / 12
    rs = adapters[PATTERNS_RSLORA]
    assert rs.delta(None, "lm_head").scaling == pytest.approx(4 / 2**0.5)  # alpha_m / √r_m, of the module's own rank
    assert rs.delta(None, "embed_tokens").scaling == pytest.approx(6 / 4**0.5)


def test_each_module_has_the_rank_and_scaling_of_peft_s_own_layers(checkpoint, adapters):
    """The oracle: PEFT builds every layer with its pattern's rank and scaling; the parser must agree."""
    transformers = pytest.importorskip("transformers", reason="the oracle needs the e2e extra")
    peft = pytest.importorskip("peft", reason="the oracle needs the e2e extra")
    for name, adapter in adapters.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float64)
            model = peft.PeftModel.from_pretrained(model, adapter.path)
        layers = {module_name.removeprefix("base_model.model."): module for module_name, module in model.named_modules()
                  if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling}
        ours = {module_path(layer, module): delta for (layer, module), delta in adapter.deltas.items()}
        assert set(layers) == set(ours), name
        for path, layer in layers.items():
            assert (ours[path].rank, ours[path].scaling) == (layer.r["default"], pytest.approx(layer.scaling["default"], abs=1e-12)), (name, path)


OVERLAPPING = {  # keys that overlap, so the order decides: the first that names the module wins
    "rank_pattern": {"layers.1.mlp.down_proj": 3, "down_proj": 5, "model.embed_tokens": 7, "self_attn\\.[qk]_proj": 9},
    "alpha_pattern": {"proj": 1, "layers.0.mlp.up_proj": 11, "lm_head": 13},
}


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("raw", [None, OVERLAPPING], ids=["fixtures", "overlapping-keys"])
def test_the_rule_is_vllm_s_for_every_module(adapters, raw, use_rslora):
    """vLLM's loader (``PEFTHelper.get_rank_and_scaling``, which the installed vLLM runs for every module it
    loads) against the parser's rule, module by module, on the fixtures' patterns and on overlapping keys."""
    peft_helper = pytest.importorskip("vllm.lora.peft_helper", reason="vLLM is not installed")
    configs = [json.loads((a.path / "adapter_config.json").read_text()) for a in adapters.values()] if raw is None else [
        {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **raw}]
    modules = [(layer, m) for layer in (0, 1) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    paths = [module_path(layer, m) for layer, m in [*modules, (None, "embed_tokens"), (None, "lm_head")]]
    for config in configs:
        config = {**config, "use_rslora": use_rslora}
        helper = peft_helper.PEFTHelper.from_dict(config)
        rule = RankRule(config["r"], float(config["lora_alpha"]), use_rslora, tuple(config["rank_pattern"].items()),
                        tuple(config["alpha_pattern"].items()))
        for path in paths:
            assert rule.of(path) == pytest.approx(helper.get_rank_and_scaling(path), abs=1e-12), (config["rank_pattern"], path)
        assert rule.max_rank == max([helper.r, *helper.rank_pattern.values()])


def test_the_stacks_pad_each_module_to_the_widest_rank_and_fold_its_own_scaling(checkpoint, adapters):
    stacks = LoRAStacks.build((adapters[PATTERNS], None, adapters[PATTERNS_RSLORA]), checkpoint.config, torch.float64, "cpu")
    assert stacks.max_rank == 12  # patterns-r8's down_proj, above both adapters' r
    for layer, q_rank, q_scaling in ((0, 4, 4.0), (1, 2, 8.0)):
        q = adapters[PATTERNS].delta(layer, "q_proj")
        b_q = stacks.layers[layer]["qkv_proj"].lora_b[0][0, 0]
        torch.testing.assert_close(b_q[:, :q_rank], q.b.double() * q_scaling)
        assert not b_q[:, q_rank:].any()
    down = adapters[PATTERNS].delta(1, "down_proj")
    torch.testing.assert_close(stacks.layers[1]["down_proj"].lora_b[0][0, 0], down.b.double() * 0.5)
    head = adapters[PATTERNS_RSLORA].delta(None, "lm_head")
    torch.testing.assert_close(stacks.lm_head.lora_b[0][2, 0, :, :2], head.b.double() * 4 / 2**0.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rank_pattern": {"down_proj": 0}}, "field 'rank_pattern' maps 'down_proj' to 0; each value must be a positive integer"),
        ({"rank_pattern": ["down_proj"]}, "field 'rank_pattern' must be a mapping"),
        ({"alpha_pattern": {"o_proj": "4"}}, "field 'alpha_pattern' maps 'o_proj' to '4'; each value must be a number"),
        ({"rank_pattern": {"q_proj(": 4}}, "field 'rank_pattern' has key 'q_proj(', not a regular expression"),
        # the tensors were saved for rank 12: a pattern saying otherwise is a shape error naming the rank
        ({"rank_pattern": {"layers.0.self_attn.q_proj": 4, "q_proj": 2}}, "module 'down_proj' (layer 0) has A (12, 128)"),
    ],
)
def test_malformed_patterns_name_the_field(tmp_path, checkpoint, adapters, changes, message):
    import shutil

    path = tmp_path / "adapter"
    shutil.copytree(adapters[PATTERNS].path, path)
    raw = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**raw, **changes}))
    with pytest.raises(ValueError) as error:
        Adapter.load(path, checkpoint.config)
    assert message in str(error.value) and str(path) in str(error.value)


# -- the cases ------------------------------------------------------------------------------------

def test_the_pattern_cases_mix_both_pattern_adapters_with_a_plain_one_and_base_requests():
    assert {(case.kind, case.dtype) for case in PATTERN_CASES} == {
        (kind, dtype) for kind in ("teacher_forced_logits", "greedy_generation") for dtype in ("float32", "bfloat16", "float16")}
    adapters = [adapter for _, adapter in BATCHES["patterns-mixed"].requests]
    assert set(adapters) == {None, ATTN, *PATTERN_ADAPTERS}
    assert all({"per_module_rank", "neg1", "last_slot"} <= case.features() for case in PATTERN_CASES)
    assert not any("per_module_rank" in case.features() for case in E2E_CASES if case.batch != "patterns-mixed")


def test_the_reference_in_the_case_dtype_passes_every_pattern_case():
    runner = E2ERunner(ReferenceTarget())
    results = {case.case_id: runner.run(case) for case in PATTERN_CASES}
    assert {r.outcome for r in results.values()} == {Outcome.PASS}, {k: r.message for k, r in results.items()}


# -- seeded faults: a loader that gets the per-module scaling wrong -------------------------------

def patterns_ignored(adapter: Adapter) -> Adapter:
    """Every module scaled by ``lora_alpha / r`` (``/ √r`` under rsLoRA), as a loader that never reads the
    patterns would; the tensors stay as stored."""
    return replace(adapter, deltas={key: replace(d, scaling=adapter.scaling) for key, d in adapter.deltas.items()})


def alpha_pattern_ignored(adapter: Adapter) -> Adapter:
    """Each module's own rank, but ``lora_alpha`` for every module: the rank pattern alone applied."""
    return replace(adapter, deltas={key: replace(d, scaling=RankRule.scaling_of(d.rank, adapter.alpha, adapter.use_rslora))
                                    for key, d in adapter.deltas.items()})


class FaultyLoader(E2ETargetRunner):
    """The target's side with its adapters loaded by a faulty loader (the referee loads them right)."""

    def __init__(self, target, fault) -> None:
        super().__init__(target)
        self.fault = fault

    def files(self, model: str) -> FixtureFiles:
        files = super().files(model)
        return replace(files, adapters={name: self.fault(a) for name, a in files.adapters.items()})


@pytest.mark.parametrize("fault", [patterns_ignored, alpha_pattern_ignored])
def test_a_loader_that_ignores_the_patterns_fails_the_pattern_adapters_requests(fault):
    runner = E2ERunner(PlainTorchTarget())
    runner.producer = FaultyLoader(runner.target, fault)
    for case in (c for c in PATTERN_CASES if c.dtype == "float32"):
        result = runner.run(case)
        assert result.outcome is Outcome.FAIL, (fault.__name__, case.case_id, result.message)
        slots, _ = slot_assignment(case.requests, case.max_loras)
        assert set(result.failing_slots) <= {slots.index(name) for name in PATTERN_ADAPTERS}, result.message
    # the same loader is right for adapters without patterns: the plain mixed batch passes
    assert runner.run(E2ECase("teacher_forced_logits", "mixed", "float32", True)).outcome is Outcome.PASS
