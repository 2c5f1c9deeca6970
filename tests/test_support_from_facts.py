"""Support decided from the target's facts, in the referee's process, before any process starts.

A target whose tensor-parallel and end-to-end cases it cannot run must cost those cases nothing: no
worker, no rank pool, no fixture model. Each level decides from the facts (``CaseKind.unsupported_reason``),
and the facts list the ops a target really implements: a ``KernelTarget`` has every wrapper method as an
attribute, but implements only those its kernels compose. The worker's own checks stay a second line and
agree with the referee's.
"""

from __future__ import annotations

import pytest
import torch
from fault_targets import PlainTorchTarget

from conformance.e2e.cases import e2e_cases
from conformance.e2e.target_runner import E2ETargetRunner
from conformance.isolation.process import IsolatedExecutor
from conformance.isolation.worker import WorkerProcess
from conformance.levels import LAYER, MODEL, OP
from conformance.ops import Level, ops_at
from conformance.session import ConformanceRun, RunSettings
from conformance.targets import TargetError, TargetUnavailable
from conformance.targets.facts import facts_from_answer, facts_of, implemented_ops_of, probe, read_facts_here
from conformance.targets.reference import ReferenceTarget
from conformance.targets.registry import BUILTIN_TARGETS, resolve
from conformance.tp.cases import tp_cases
from conformance.tp.moe_case import MoETPCase
from conformance.verdict import Outcome

EXPAND_KERNELS = ("lora_expand", "lora_expand_fp8", "sgmv_expand", "sgmv_expand_slice", "bgmv_expand", "bgmv_expand_slice")


class ShrinkOnlyKernels(PlainTorchTarget):
    """A kernel-only target without any expand kernel or fused MoE kernel: its wrapper methods that need
    one are attributes it inherits from ``KernelTarget``, but not ops it implements."""

    name = "shrink-only-kernels"
    lora_expand = lora_expand_fp8 = sgmv_expand = sgmv_expand_slice = bgmv_expand = bgmv_expand_slice = None
    fused_moe_lora = fused_moe_lora_fp8 = None


class Bfloat16WrapperOnly(ReferenceTarget):
    """A wrapper-only target (no kernel op) that claims bfloat16 alone and has no add_expand."""

    name = "bf16-wrapper-only"
    dtypes = frozenset({torch.bfloat16})
    add_expand = None


for _kernel in ops_at(Level.KERNEL):  # every kernel op the reference has, set to None: not defined
    setattr(Bfloat16WrapperOnly, _kernel, None)
del _kernel


def test_facts_of_a_kernel_target_list_only_the_wrapper_methods_its_kernels_compose():
    facts = facts_of(ShrinkOnlyKernels)
    assert facts.defines("lora_shrink") and facts.defines("add_shrink") and facts.defines("update_metadata")
    for derived in ("add_expand", "add_lora_linear", "add_lora_embedding", "add_lora_logits", "add_lora_w13", "add_lora_w2"):
        assert callable(getattr(ShrinkOnlyKernels, derived)) and not facts.defines(derived), derived
    assert not any(facts.defines(kernel) for kernel in EXPAND_KERNELS)
    # the class's answer is the instance's: implemented_ops() read without making a target
    assert set(implemented_ops_of(ShrinkOnlyKernels)) == set(ShrinkOnlyKernels().implemented_ops())


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_the_wrapper_ops_in_the_facts_are_those_the_loaded_target_implements():
    """The op level decides wrapper ops from the facts; a built-in target's worker must say the same."""
    checked = []
    for name in [*BUILTIN_TARGETS, "plain_lora_backend.target:PlainExampleTarget"]:
        cls = resolve(name)
        try:
            cls.check_available()
        except TargetUnavailable:
            continue
        wrappers = set(ops_at(Level.WRAPPER))
        assert set(facts_of(cls).methods) & wrappers == set(cls().implemented_ops()) & wrappers, name
        checked.append(name)
    assert {"reference", "hpu-emulated", "plain_lora_backend.target:PlainExampleTarget"} <= set(checked)


def test_each_level_refuses_from_the_facts_what_the_target_lacks():
    facts = facts_of(Bfloat16WrapperOnly)
    linear = [case for case in tp_cases("smoke", 0) if not isinstance(case, MoETPCase)]
    assert linear and all("does not implement add_expand" in LAYER.unsupported_reason(facts, case) for case in linear)
    with_expand = facts_of(type("Bfloat16Wrapper", (Bfloat16WrapperOnly,), {"add_expand": ReferenceTarget.add_expand}))
    for case in linear:
        reason = LAYER.unsupported_reason(with_expand, case)
        assert (reason is None) == (case.dtype == "bfloat16"), (case.case_id, reason)
    assert {case.dtype for case in e2e_cases("standard")} >= {"bfloat16", "float32"}
    for case in e2e_cases("standard"):  # the decoder calls add_lora_linear, which this target defines itself
        reason = MODEL.unsupported_reason(facts, case)
        assert (reason is None) == (case.dtype == "bfloat16"), (case.case_id, reason)
        assert reason is None or reason == f"bf16-wrapper-only does not support {case.dtype}"


def test_the_op_level_refuses_a_wrapper_op_in_the_workers_words_and_leaves_kernel_ops_to_the_worker():
    facts, target = facts_of(ShrinkOnlyKernels), ShrinkOnlyKernels()
    by_op = {case.op: case for _, case in OP.cases("smoke", 0)}
    assert OP.unsupported_reason(facts, by_op["add_expand"]) == target.not_implemented_reason("add_expand")
    assert OP.unsupported_reason(facts, by_op["add_shrink"]) is None
    assert OP.unsupported_reason(facts, by_op["lora_expand"]) is None  # a kernel may be bound in __init__: the worker says


def test_the_workers_end_to_end_check_agrees_with_the_referees():
    vllm_engine = type("VllmEngineShrinkOnly", (ShrinkOnlyKernels,), {"generation_engine": "vllm"})
    for cls in (ShrinkOnlyKernels, PlainTorchTarget, Bfloat16WrapperOnly, vllm_engine):
        facts, runner = facts_of(cls), E2ETargetRunner(cls())
        for case in e2e_cases("standard"):
            assert MODEL.unsupported_reason(facts, case) == runner.unsupported_reason(case), (cls.__name__, case.case_id)


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_tp_and_e2e_cases_the_facts_refuse_start_no_process_and_load_no_fixture(tmp_path, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a worker or rank process was started for a case the facts refuse")

    def no_fixtures(*args, **kwargs):
        raise AssertionError("the end-to-end fixtures were loaded for a case the facts refuse")

    monkeypatch.setattr(WorkerProcess, "spawn", no_process)
    monkeypatch.setattr("conformance.e2e.run.E2EReferee.__init__", no_fixtures)
    target = f"{__name__}:ShrinkOnlyKernels"
    facts = probe(target)  # read as a run reads them: in a process that imports the target
    assert facts == facts_of(ShrinkOnlyKernels)
    run = ConformanceRun(RunSettings(target=target, profile="smoke", report_dir=str(tmp_path)), facts=facts, kinds=(LAYER, MODEL))
    run.start_worker()  # nothing here runs in the worker: it stays unstarted
    document = run.run_all()
    results = document["results"]
    assert len(results) == len(tp_cases("smoke", 0)) + len(e2e_cases("smoke"))
    assert {r["outcome"] for r in results} == {Outcome.NOT_SUPPORTED.value}
    for record in results:
        assert record["message"].startswith("shrink-only-kernels does not implement add_"), record
    assert run._tp_executor is None and run._e2e_referee is None
    assert all(worker.get("tp_pool_starts", 0) == 0 for worker in document["workers"])


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_the_worker_starts_early_only_for_a_case_it_would_run(tmp_path, monkeypatch):
    starts = []
    monkeypatch.setattr(IsolatedExecutor, "start", lambda self: starts.append(self))
    # the facts handed over, as an xdist worker gets them from its controller (a serial run reads them from its
    # worker, so that worker is started at once)
    run = ConformanceRun(RunSettings(target="reference", profile="smoke", report_dir=str(tmp_path)), facts=facts_of(ReferenceTarget))
    ids_of = {case.op: case_id for case_id, case in run.cases_by_id().items() if OP.owns(case)}
    run.start_worker([case.case_id for case in tp_cases("smoke", 0)])  # the rank pool runs them, not the worker
    assert starts == []
    run.facts = facts_of(ShrinkOnlyKernels)
    run.start_worker([ids_of["add_expand"], ids_of["add_lora_linear"]])  # refused by the facts
    assert starts == []
    run.start_worker([ids_of["add_expand"], ids_of["add_shrink"]])
    assert len(starts) == 1


def test_the_answer_about_a_target_is_read_as_data_and_anything_else_is_named():
    # what the worker sends first (and the facts process prints), read back in the referee
    assert facts_from_answer("reference", read_facts_here("reference")) == facts_of(ReferenceTarget)
    with pytest.raises(TargetUnavailable, match="^no device here$"):
        facts_from_answer("t", {"unavailable": "no device here"})
    with pytest.raises(TargetError, match="^no target named t$"):
        facts_from_answer("t", {"unknown": "no target named t"})
    good = read_facts_here("reference")["facts"]
    for answer in ([], "facts", {}, {"facts": good, "unknown": "x"}, {"bogus": "x"}, {"unavailable": 5},
                   {"facts": {**good, "name": 3}}, {"facts": {**good, "methods": "all"}}, {"facts": None}):
        with pytest.raises(TargetError, match="^target 't': the process reading its facts answered what is not facts: "):
            facts_from_answer("t", answer)


def test_an_unknown_target_is_answered_not_raised_where_it_is_imported():
    assert set(read_facts_here("no_such_package.module:Target")) == {"unknown"}
    assert set(read_facts_here(f"{__name__}:NoSuchClass")) == {"unknown"}
