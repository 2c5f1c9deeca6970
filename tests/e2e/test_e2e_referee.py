"""The two halves of an end-to-end case: the target's side produces plain data, the referee judges it.

The referee (the float64 reference and the judgement) must never share a process with the target's code,
so it imports none of it, and what the target's side hands over is plain data (JSON across the pipe) the referee does
not trust: a production tampered with after the fact fails, a malformed one is not judged as if it were
whole, and repetitions of a production are compared bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fault_targets import PlainTorchTarget

from conformance.e2e.cases import E2ECase
from conformance.e2e.generation import Generation, Request, Step, slot_assignment
from conformance.e2e.production import RAISED, RAN, BatchRun, E2EProduction, batch_plan, plain_generation, read_production
from conformance.e2e.referee import E2EReferee
from conformance.e2e.run import E2ERunner
from conformance.e2e.target_runner import E2ETargetRunner
from conformance.verdict import FailureKind, Outcome
from conformance.wire import WireError, to_data

# the one-slot batch: base, all-linear-r16-rslora, base, all-linear-r16-rslora (slots -1, 0, -1, 0)
TEACHER_FORCED = E2ECase("teacher_forced_logits", "one-slot", "float32", False)
GREEDY = E2ECase("greedy_generation", "one-slot", "float32", False)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def referee() -> E2EReferee:
    return E2EReferee()


@pytest.fixture(scope="module")
def producer() -> E2ETargetRunner:
    return E2ETargetRunner(PlainTorchTarget())


@pytest.fixture(scope="module")
def productions(referee, producer) -> dict[str, E2EProduction]:
    """A correct target's productions of the two one-slot cases, teacher forcing repeated twice."""
    return {
        TEACHER_FORCED.kind: producer.produce(TEACHER_FORCED, referee.continuations(TEACHER_FORCED), runs=2),
        GREEDY.kind: producer.produce(GREEDY, referee.continuations(GREEDY)),
    }


def retouched(production: E2EProduction, output: str, request: int, change) -> E2EProduction:
    """A copy whose first repetition's whole batch has ``change`` applied to one request's generation."""
    first, *others = production.repetitions
    whole = first[0]
    generations = list(getattr(whole, output))
    generations[request] = change(generations[request])
    return replace(production, repetitions=[(replace(whole, **{output: tuple(generations)}), *first[1:]), *others])


def at_step(position: int, **changes):
    """A change of one step of a generation."""
    def change(generation: Generation) -> Generation:
        steps = list(generation.steps)
        steps[position] = replace(steps[position], **changes)
        return replace(generation, steps=tuple(steps))
    return change


def slot_of(case: E2ECase, request: int) -> int:
    return slot_assignment(case.requests, case.max_loras)[1][request]


# -- the referee runs nowhere near a target -------------------------------------------------------

@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_the_referee_imports_no_target_and_judges_a_production_sent_as_data_in_a_process_of_its_own(tmp_path, productions):
    """What the harness does: the target's production crosses a pipe as JSON; the referee's process reads it back
    from its declared types and judges it without importing the target, its module, vLLM or the target's side."""
    (tmp_path / "production.json").write_text(json.dumps(to_data(productions[GREEDY.kind])))
    script = f"""
import json, sys
from pathlib import Path
from conformance.e2e.cases import E2ECase
from conformance.e2e.production import read_production
from conformance.e2e.referee import E2EReferee
referee = E2EReferee()
case = E2ECase("greedy_generation", "one-slot", "float32", False)
referee.continuations(case)
data = json.loads(Path({str(tmp_path / "production.json")!r}).read_text())
result = referee.judge(case, read_production(data, case, 1))
print(json.dumps({{"outcome": result.outcome.value, "modules": sorted(sys.modules)}}))
"""
    completed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.splitlines()[-1])
    assert report["outcome"] == "pass"
    modules = report["modules"]
    for forbidden in ("conformance.targets.hpu", "conformance.targets.vllm_cpu", "conformance.targets.vllm_cuda", "vllm",
                      "fault_targets", "conformance.e2e.target_runner", "conformance.e2e.vllm_engine", "conformance.e2e.run"):
        assert forbidden not in modules, forbidden
    assert not [m for m in modules if m.startswith("vllm.")]
    targets = {m for m in modules if m.startswith("conformance.targets")}
    assert targets <= {"conformance.targets", "conformance.targets.base", "conformance.targets.registry",
                       "conformance.targets.device_traits", "conformance.targets.reference"}, targets
    assert "conformance.targets.reference" in targets  # the golden reference is the referee's own code


def test_a_production_is_plain_data_that_round_trips_as_json(productions):
    for kind, production in productions.items():
        assert production.status == RAN
        data = json.loads(json.dumps(to_data(production)))
        case = {TEACHER_FORCED.kind: TEACHER_FORCED, GREEDY.kind: GREEDY}[kind]
        assert read_production(data, case, production.runs) == production, kind
        with pytest.raises(WireError, match="not"):
            read_production({**data, "case_id": "another-case"}, case, production.runs)
        with pytest.raises(WireError, match="repetition"):
            read_production(data, case, production.runs - 1)


def test_an_engines_tensors_and_subclasses_become_plain_values():
    class MyStep(Step):
        pass

    step = MyStep(torch.tensor(3), torch.tensor(-0.25, dtype=torch.float64), ((torch.tensor(3), torch.tensor(-0.25)),))
    plain = plain_generation(Generation(Request("p", None), (torch.tensor(1), 2), (step,)))
    assert type(plain.steps[0]) is Step and plain.steps[0] == Step(3, -0.25, ((3, -0.25),))
    assert plain.prompt_ids == (1, 2) and all(type(t) is int for t in plain.prompt_ids)
    assert json.loads(json.dumps(to_data(plain))) == to_data(plain)


# -- the referee judges what it is handed, and trusts none of it -----------------------------------

def test_the_untouched_productions_pass(referee, productions):
    for case in (TEACHER_FORCED, GREEDY):
        result = referee.judge(case, productions[case.kind])
        assert result.outcome is Outcome.PASS, result.message


@pytest.mark.parametrize(
    ("case", "output", "request_index", "change", "kind", "says"),
    [
        (TEACHER_FORCED, "scored", 1, lambda step: {"logprob": step.logprob - 0.5}, FailureKind.NUMERICS, "error 0.5"),
        (TEACHER_FORCED, "scored", 0, lambda step: {"token": step.token + 1}, FailureKind.WRONG_OUTPUT_TYPE,
         "other tokens than the continuation fed"),
        (GREEDY, "generated", 3, lambda step: {"token": step.token + 1}, FailureKind.TOKENS, "greedy output diverges"),
    ],
    ids=["one-logprob", "one-fed-token", "one-greedy-token"],
)
def test_a_tampered_production_fails_for_the_request_tampered_with(referee, productions, case, output, request_index, change,
                                                                   kind, says):
    production = productions[case.kind]
    reference = referee.reference_generations(case)[request_index]
    position = max(range(len(reference.steps)), key=lambda p: reference.steps[p].margin)  # no near-tie there
    step = getattr(production.repetitions[0][0], output)[request_index].steps[position]
    result = referee.judge(case, retouched(production, output, request_index, at_step(position, **change(step))))
    assert result.outcome is Outcome.FAIL, result.message
    assert result.failing_slots == (slot_of(case, request_index),) and kind in result.kinds, result.message
    assert says in result.message and f"1 of {len(case.requests)} requests fail" in result.message


def test_a_production_missing_a_generation_is_malformed_not_judged_on_the_rest(referee, productions):
    production = retouched(productions[GREEDY.kind], "generated", 0, lambda g: g)
    whole = production.repetitions[0][0]
    production.repetitions[0] = (replace(whole, generated=whole.generated[:-1]), *production.repetitions[0][1:])
    result = referee.judge(GREEDY, production)
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.WRONG_OUTPUT_TYPE,)
    assert "generated 3 generations for its 4 requests" in result.message


def test_a_production_of_other_batches_or_another_case_is_refused(referee, productions):
    production = productions[GREEDY.kind]
    with pytest.raises(ValueError, match="cannot be judged as"):
        referee.judge(TEACHER_FORCED, production)
    renamed = replace(production, repetitions=[(BatchRun("alone 0", (0,)),)])
    with pytest.raises(ValueError, match="not the case's plan"):
        referee.judge(GREEDY, renamed)


def test_the_target_side_needs_one_continuation_per_request(producer):
    with pytest.raises(ValueError, match="one per request"):
        producer.produce(TEACHER_FORCED, [[1, 2]])


def test_a_raising_target_is_broken_with_its_whole_traceback(referee):
    class Raising(PlainTorchTarget):
        def add_lora_linear(self, *args, **kwargs):
            raise RuntimeError("the kernel fell over")

    production = E2ETargetRunner(Raising()).produce(GREEDY, None)
    assert production.status == RAISED and not production.repetitions
    assert production.message.startswith("RuntimeError: the kernel fell over (at ")
    # formatted on the target's side: from the runner through the engine into the target's method
    assert production.traceback.startswith("Traceback (most recent call last):")
    assert 'target_runner.py", line' in production.traceback and "in add_lora_linear" in production.traceback
    assert production.traceback.endswith("RuntimeError: the kernel fell over")
    result = referee.judge(GREEDY, read_production(json.loads(json.dumps(to_data(production))), GREEDY, 1))
    assert result.outcome is Outcome.BROKEN and result.kinds == (FailureKind.RAISED,)
    assert result.traceback == production.traceback and result.to_json()["traceback"] == production.traceback


def test_the_referee_reads_the_fixtures_itself(tmp_path):
    with pytest.raises(FileNotFoundError, match="end-to-end fixtures not found"):
        E2EReferee(tmp_path)


# -- repetitions: a determinism measure ------------------------------------------------------------

def test_two_runs_of_a_correct_target_are_identical(referee, productions):
    production = productions[TEACHER_FORCED.kind]
    assert production.runs == 2 and production.repetitions[0] == production.repetitions[1]
    result = referee.judge(TEACHER_FORCED, production)
    assert result.outcome is Outcome.PASS and result.stability == "deterministic"
    assert result.determinism == {"runs": 2, "identical": True, "max_logprob_difference": 0.0}
    assert result.to_json()["determinism"] == result.determinism
    one_run = referee.judge(GREEDY, productions[GREEDY.kind])
    assert one_run.determinism is None and one_run.to_json()["determinism"] is None


def test_repetitions_that_differ_are_recorded_and_the_first_is_judged(referee, productions):
    production = productions[TEACHER_FORCED.kind]
    first, second = production.repetitions
    whole = second[0]
    step = whole.scored[2].steps[5]
    nudged = replace(whole.scored[2], steps=whole.scored[2].steps[:5] + (replace(step, logprob=step.logprob - 1e-3),)
                     + whole.scored[2].steps[6:])
    changed = replace(production, repetitions=[first, (replace(whole, scored=(*whole.scored[:2], nudged, *whole.scored[3:])),
                                                       *second[1:])])
    result = referee.judge(TEACHER_FORCED, changed)
    assert result.outcome is Outcome.PASS and result.stability == "nondeterministic"
    assert result.determinism["runs"] == 2 and result.determinism["identical"] is False
    assert result.determinism["max_logprob_difference"] == pytest.approx(1e-3)


def test_the_in_process_runner_composes_both_halves_with_repetitions():
    result = E2ERunner(PlainTorchTarget()).run(GREEDY, runs=2)
    assert result.outcome is Outcome.PASS and result.determinism["identical"], result.message
    assert [p.name for p in batch_plan(E2ECase("order_invariance", "mixed", "float32", False))] == [
        "batch", "reversed", "rotated", "LoRA disabled", "graphs"]
