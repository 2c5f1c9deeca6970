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

from conformance.e2e.adapters import Adapter
from conformance.e2e.cases import BATCHES, E2E_CASES, E2ECase, e2e_cases
from conformance.e2e.checkpoint import Checkpoint, ModelConfig
from conformance.e2e.compare import GENERATION_TOLERANCES, Comparison
from conformance.e2e.generation import Generation, Request, Step, slot_assignment
from conformance.e2e.run import fixtures_dir

FIXTURES = fixtures_dir()
MODEL = FIXTURES / "tiny-llama"
ADAPTER = FIXTURES / "adapters" / "attn-qv-r8"


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return Checkpoint.load(MODEL).config


def copy_adapter(tmp_path: Path) -> Path:
    target = tmp_path / "adapter"
    shutil.copytree(ADAPTER, target)
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


def test_every_batch_names_fixture_adapters_and_fits_its_slots():
    names = {p.name for p in (FIXTURES / "adapters").iterdir()}
    for name, (requests, max_loras) in BATCHES.items():
        used = {adapter for _, adapter in requests if adapter}
        assert used <= names, name
        assert len(used) in (0, max_loras), name  # no slot left empty by a batch that uses adapters: cases.py


def test_the_mixed_batch_exposes_the_no_adapter_corner():
    case = E2ECase("greedy_generation", "mixed", "float32", True)
    assert {"neg1", "last_slot"} <= case.features()
    assert "allneg1" in E2ECase("greedy_generation", "base-only", "float32", False).features()


def test_smoke_is_a_subset_and_standard_has_every_kind_and_dtype():
    smoke, standard = e2e_cases("smoke"), e2e_cases("standard")
    assert set(smoke) < set(standard) == set(E2E_CASES)
    assert {c.kind for c in standard} == {"teacher_forced_logits", "greedy_generation", "batch_invariance", "order_invariance"}
    assert {c.dtype for c in standard} == {"float32", "bfloat16", "float16"}
    assert len({c.case_id for c in standard}) == len(standard)
