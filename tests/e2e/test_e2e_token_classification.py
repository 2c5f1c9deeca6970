"""End to end on the token classifier: per-token label logits, adapters that save a whole head.

``tiny-llama-tokcls`` is transformers' ``LlamaForTokenClassification`` (11 labels, no multiple of 16). Two
adapters save a head of their own (PEFT ``modules_to_save``), one does not. The decoder computes the heads as
vLLM 0.33's token head layer does: the base head in plain torch, every token through the target's
``add_shrink`` with the saved heads as the stack, then per token the slot's head (plus bias) where its adapter
saved one, else the base head's output. The reference is checked against transformers + PEFT; vLLM engine
targets report the cases not supported, naming vLLM 0.32's refusal.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from fault_targets import LastSlotNeverApplied, PlainTorchTarget

from conformance.e2e.adapters import Adapter
from conformance.e2e.cases import (
    E2E_CASES,
    O_DOWN_HEAD,
    PROMPTS,
    QKV_NO_HEAD,
    QV_HEAD,
    TOKCLS_ADAPTERS,
    TOKCLS_MODEL,
)
from conformance.e2e.checkpoint import Checkpoint
from conformance.e2e.fixture_files import fixtures_dir
from conformance.e2e.generation import Request, slot_assignment
from conformance.e2e.lora_stacks import LoRAStacks
from conformance.e2e.run import E2ERunner
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome

FIXTURES = fixtures_dir()
TOKCLS_CASES = [case for case in E2E_CASES if case.is_token_classifier]
MIXED = [Request(PROMPTS[i], name) for i, name in enumerate([O_DOWN_HEAD, None, QKV_NO_HEAD, QV_HEAD, None, O_DOWN_HEAD])]


@pytest.fixture(scope="module")
def runner() -> E2ERunner:
    return E2ERunner(ReferenceTarget())


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return Checkpoint.load(FIXTURES / TOKCLS_MODEL)


def peft_label_logits(adapter: str | None, ids: list[int]) -> torch.Tensor:
    """transformers (+ PEFT, with the adapter's saved head) label logits of every token, float64."""
    transformers = pytest.importorskip("transformers", reason="the oracle needs the e2e extra (transformers, peft)")
    peft = pytest.importorskip("peft", reason="the oracle needs the e2e extra (transformers, peft)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForTokenClassification.from_pretrained(FIXTURES / TOKCLS_MODEL, dtype=torch.float64)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, FIXTURES / "tokcls-adapters" / adapter)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


# -- the fixture and the oracle -------------------------------------------------------------------

def test_the_model_is_a_token_classifier_whose_label_count_is_no_multiple_of_16(checkpoint):
    labels = checkpoint.config.num_labels
    assert labels % 16 and checkpoint.weights["score.weight"].shape == (labels, checkpoint.config.hidden_size)
    assert "lm_head.weight" not in checkpoint.weights


def test_two_adapters_save_a_head_and_one_does_not(runner):
    adapters = runner.model(TOKCLS_MODEL).adapters
    assert {name for name, a in adapters.items() if a.head is not None} == {QV_HEAD, O_DOWN_HEAD}
    assert adapters[QKV_NO_HEAD].head is None and adapters[QKV_NO_HEAD].deltas  # LoRA on the backbone only
    for name in (QV_HEAD, O_DOWN_HEAD):  # a head of its own, not the base head
        assert not torch.equal(adapters[name].head.weight, runner.model(TOKCLS_MODEL).checkpoint.weights["score.weight"])


def test_the_reference_decoder_matches_transformers_and_peft_per_token_in_a_mixed_batch(runner):
    """Every request of a batch mixing saved heads, an adapter without one and base tokens, against PEFT
    running that request alone; transformers computes its rotary tables in float32 (about 1e-6)."""
    engine = runner.model(TOKCLS_MODEL).reference
    for request, logits in zip(MIXED, engine.classify(MIXED, max_loras=3)):
        oracle = peft_label_logits(request.adapter, engine.encode(request.prompt))
        torch.testing.assert_close(logits, oracle, atol=1e-4, rtol=0, msg=request.describe())


def test_every_adapter_changes_the_labels(runner):
    """A target that drops a saved head, or gives it to the wrong tokens, changes the argmax labels."""
    engine = runner.model(TOKCLS_MODEL).reference
    prompt = " ".join(PROMPTS)
    labels = {name: tuple(engine.classify([Request(prompt, name)], 1)[0].argmax(-1).tolist()) for name in (None, *TOKCLS_ADAPTERS)}
    assert len(set(labels.values())) == len(labels), labels


def test_the_head_stack_holds_the_saved_heads_and_flags_the_slots_that_have_one(runner, checkpoint):
    adapters = runner.model(TOKCLS_MODEL).adapters
    stacks = LoRAStacks.build((adapters[O_DOWN_HEAD], adapters[QKV_NO_HEAD], None), checkpoint.config, torch.float32, "cpu")
    assert stacks.head.weight.shape == (3, 1, 11, 32) and stacks.head.enabled.tolist() == [True, False, False]
    torch.testing.assert_close(stacks.head.weight[0, 0], adapters[O_DOWN_HEAD].head.weight)
    torch.testing.assert_close(stacks.head.bias[0], adapters[O_DOWN_HEAD].head.bias)
    assert not stacks.head.weight[1:].any() and not stacks.head.bias[1:].any()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"modules_to_save": ["score", "lm_head"]}, "field 'modules_to_save' names ['lm_head']; only the classification head"),
        ({"modules_to_save": None}, "saves 'score', which modules_to_save does not list"),
    ],
)
def test_malformed_saved_heads_name_the_field(tmp_path, checkpoint, changes, message):
    path = tmp_path / "adapter"
    shutil.copytree(FIXTURES / "tokcls-adapters" / QV_HEAD, path)
    raw = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**raw, **changes}))
    with pytest.raises(ValueError) as error:
        Adapter.load(path, checkpoint.config)
    assert message in str(error.value)


def test_a_causal_lm_refuses_modules_to_save(tmp_path):
    path = tmp_path / "adapter"
    shutil.copytree(FIXTURES / "adapters" / "attn-qv-r8", path)
    raw = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**raw, "modules_to_save": ["score"]}))
    with pytest.raises(ValueError, match="supported only on a token classifier"):
        Adapter.load(path, Checkpoint.load(FIXTURES / "tiny-llama").config)


# -- the cases ------------------------------------------------------------------------------------

def test_the_token_classification_cases_are_one_check_in_three_dtypes_beside_the_generation_cases():
    assert {(case.kind, case.batch) for case in TOKCLS_CASES} == {("token_classification", "tokcls-mixed")}
    assert {case.dtype for case in TOKCLS_CASES} == {"float32", "bfloat16", "float16"}
    assert all({"token_classification", "module_disabled", "neg1", "last_slot"} <= case.features() for case in TOKCLS_CASES)
    assert not any("token_classification" in case.features() for case in E2E_CASES if not case.is_token_classifier)


class ShrinkRecorder(ReferenceTarget):
    """The reference, recording every ``add_shrink`` call's output and stack shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        self.calls.append((tuple(y.shape), y.dtype, tuple(x.shape), tuple(s.shape for s in lora_a_stacked), scale))
        super().add_shrink(y, x, lora_a_stacked, scale, **kwargs)


def test_the_head_is_one_add_shrink_call_over_every_token_with_the_whole_heads_as_the_stack(runner):
    fixture = runner.model(TOKCLS_MODEL)
    recorder = ShrinkRecorder()
    from conformance.e2e.decoder_engine import DecoderEngine

    engine = DecoderEngine(recorder, fixture.checkpoint, fixture.adapters, torch.bfloat16)
    engine.classify(MIXED, max_loras=3)
    tokens = sum(len(engine.encode(r.prompt)) for r in MIXED)
    # the reference's add_lora_linear shrinks through add_shrink too: the head's is the last call, and the only one
    # whose stack is the heads (11 labels as the rank)
    assert recorder.calls[-1] == ((1, tokens, 11), torch.float32, (tokens, 32), ((3, 1, 11, 32),), 1.0)
    assert [call for call in recorder.calls if call[3] == ((3, 1, 11, 32),)] == recorder.calls[-1:]


def test_the_reference_and_a_plain_target_pass_every_token_classification_case():
    for target in (ReferenceTarget(), PlainTorchTarget()):
        results = E2ERunner(target).run
        outcomes = {case.case_id: results(case) for case in TOKCLS_CASES}
        assert {r.outcome for r in outcomes.values()} == {Outcome.PASS}, {k: r.message for k, r in outcomes.items()}


def test_a_lost_last_slot_fails_the_tokens_of_the_head_in_it():
    """The last slot holds a saved head (and q/v LoRA): a target that never applies it fails those requests only."""
    case = TOKCLS_CASES[0]
    result = E2ERunner(LastSlotNeverApplied()).run(case)
    slots, _ = slot_assignment(case.requests, case.max_loras)
    assert result.outcome is Outcome.FAIL and slots[-1] == QV_HEAD
    assert set(result.failing_slots) == {len(slots) - 1}, result.message
    assert "LABEL_" in result.message  # labels, not vocabulary tokens


def test_a_vllm_engine_target_reports_the_token_classification_cases_not_supported_naming_why():
    class VllmEngineTarget(ReferenceTarget):
        name = "vllm-like"
        generation_engine = "vllm"

    runner = E2ERunner(VllmEngineTarget())
    for case in TOKCLS_CASES:
        result = runner.run(case)
        assert result.outcome is Outcome.NOT_SUPPORTED, result.message
        assert "_validate_token_classification_lora" in result.message and "modules_to_save" in result.message


def test_a_decoder_target_without_add_shrink_reports_the_cases_not_supported():
    class NoShrink(ReferenceTarget):
        name = "no-shrink"
        add_shrink = None

    result = E2ERunner(NoShrink()).run(TOKCLS_CASES[0])
    assert result.outcome is Outcome.NOT_SUPPORTED and "add_shrink" in result.message
