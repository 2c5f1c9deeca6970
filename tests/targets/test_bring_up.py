"""The bring-up kit: a backend implements the kernels, the suite does the rest.

* the example out-of-tree backend (``examples/plain-lora-backend``, installed by
  ``scripts/install-cpu-env``) is registered as ``plain-example`` and passes the smoke gate with
  nothing "not supported" but the fused-MoE ops (it defines the ten dense kernels only, fp8 ones included), run as a
  vendor runs it (pytest in a subprocess; serial, as ``-n 2`` was measured slower for this one: 29 s
  against 18 s on two cores);
* its kernels also carry the wrapper level composed like vLLM's CPU wrapper (sgmv / bgmv);
* ``KernelTarget`` follows the specs' compositions (``OpSpec.compositions`` / ``composed_of``): with only
  a composition's kernels it derives the wrapper op, calls those kernels and no other, and passes;
  removing one kernel from a backend with all of them (``PlainTorchTarget``) makes exactly the ops whose
  compositions need it "not supported", for each composition order;
* one kernel family alone (the three bgmv ops, the three sgmv ops, or ``lora_shrink`` + ``lora_expand``)
  gives every dense wrapper method under the default ``wrapper_paths``, passes their cases and calls no
  other kernel; a bug seeded in the family's ``bgmv_expand_slice`` fails the wrapper ops composed from it;
* the MoE wrapper ops are composed as documented: block-aligned metadata from the target's own
  ``moe_lora_align_block_size``, or the naive form with the pairs' local experts; shared stacks
  expanded with stride 0; composed from the reference's own kernels they pass every MoE wrapper case;
* a wrapper method the vendor defines wins over the derived one;
* ``python -m conformance.targets describe`` says which ops are implemented, derived, or missing.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from example_backends import installed_example
from fault_targets import PlainTorchTarget

from conformance import reference
from conformance.cases import Case
from conformance.generator.profiles import profile_cases
from conformance.ops import COMPOSITIONS, OP_SPECS, case_mapping
from conformance.runner import run_case
from conformance.targets import KERNEL_OPS, WRAPPER_OPS, TargetUnavailable, known_targets, resolve
from conformance.targets._vllm import vllm_version
from conformance.targets.describe import describe_class
from conformance.targets.kernel_target import KernelTarget
from conformance.targets.vllm034_layers import VLLM_034_LAYERS
from conformance.targets.vllm_wrapper import vllm_release
from conformance.verdict import Outcome

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plain-lora-backend"
ALL_OPS = KERNEL_OPS + WRAPPER_OPS
MOE_OPS = tuple(op for op in ALL_OPS if "routing" in OP_SPECS[op].knobs)  # the fused-MoE ops (docs/moe.md)
MOE_KERNELS = tuple(op for op in MOE_OPS if op in KERNEL_OPS)
MOE_WRAPPERS = tuple(op for op in MOE_OPS if op in WRAPPER_OPS)
FP8_OPS = tuple(op for op in ALL_OPS if "fp8_scales" in OP_SPECS[op].knobs)  # lora_shrink_fp8, lora_expand_fp8
LEFT_OUT = MOE_OPS  # what the example leaves out on purpose (PlainExampleTarget.why_not_implemented)
EXAMPLE_KERNELS = tuple(op for op in KERNEL_OPS if op not in LEFT_OUT)  # what the example defines
EXAMPLE_OPS = tuple(op for op in ALL_OPS if op not in LEFT_OUT)
DTYPES = ("float16", "bfloat16", "float32")


@pytest.fixture(scope="module")
def example_class():
    """``PlainExampleTarget``, or a failure saying how to install the example (CI installs it)."""
    return installed_example("plain_lora_backend", "PlainExampleTarget", "plain-lora-backend")


@pytest.fixture(scope="module")
def smoke_cases() -> list[tuple[str, Case]]:
    return profile_cases("smoke")


@pytest.fixture(scope="module")
def cheapest_per_op(smoke_cases) -> dict[str, tuple[str, Case]]:
    cheapest: dict[str, tuple[str, Case]] = {}
    for case_id, case in sorted(smoke_cases, key=lambda pair: pair[1].cost):
        cheapest.setdefault(case.op, (case_id, case))
    assert set(cheapest) == set(ALL_OPS)
    return cheapest


def run_command(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# -- (a) the example backend: installed, registered, passes the smoke gate ---------------------------


def test_the_example_backend_is_installed_and_registered_by_name(example_class):
    assert importlib.metadata.distribution("plain-lora-backend").version
    assert known_targets()["plain-example"] == "plain_lora_backend.target:PlainExampleTarget"
    assert resolve("plain-example") is example_class


def test_the_example_declares_its_entry_point_and_unpinned_dependencies():
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["lora_conformance.targets"] == {"plain-example": "plain_lora_backend.target:PlainExampleTarget"}
    assert sorted(project["dependencies"]) == ["lora-conformance", "torch"]


def test_the_example_implements_kernels_only_and_not_from_the_reference(example_class):
    target = example_class()
    assert isinstance(target, KernelTarget)
    assert target.kernel_ops() == EXAMPLE_KERNELS
    assert not [op for op in WRAPPER_OPS if target.overrides(op)]
    assert target.implemented_ops() == EXAMPLE_OPS  # without fused_moe_lora, no MoE wrapper op either
    source = "\n".join(path.read_text() for path in (EXAMPLE / "plain_lora_backend").glob("*.py"))
    assert "conformance.reference" not in source and "from conformance import reference" not in source


@pytest.mark.integration  # the example backend's whole smoke run
def test_the_example_passes_the_smoke_gate_with_only_the_moe_ops_unsupported(example_class, tmp_path):
    completed = run_command(
        "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--target=plain-example", "--profile=smoke",
        "--report-dir", str(tmp_path),
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    counts = report["gate"]["counts"]
    assert report["gate"]["passed"]
    assert counts["fail"] == counts["broken"] == counts["known failure"] == 0, counts
    op_results = [r for r in report["results"] if r["level"] in ("kernel", "wrapper")]  # not model, layer or an installed level
    assert {r["op"] for r in op_results} == set(ALL_OPS)
    assert len(op_results) > 500
    # the op cases: every fused-MoE one not supported (no MoE kernel), every other one passes
    assert {r["outcome"] for r in op_results if r["op"] in LEFT_OUT} == {"not supported"}
    assert {r["outcome"] for r in op_results if r["op"] not in LEFT_OUT} == {"pass"}
    # end to end too: the suite's decoder runs on the wrapper methods composed from the kernels (an MoE
    # model's cases are not supported, as its LoRA calls need add_lora_w13 / add_lora_w2)
    model = [r for r in report["results"] if r["level"] == "model"]
    assert {"teacher_forced_logits", "greedy_generation", "batch_invariance"} <= {r["op"] for r in model if r["outcome"] == "pass"}
    assert {r["outcome"] for r in model} <= {"pass", "not supported"}


# -- (b) kernels only also carry the wrapper level composed from the classic ops ----------------------


def test_the_example_kernels_pass_every_wrapper_smoke_case_through_the_classic_ops(example_class, smoke_cases):
    classic = type("PlainExampleClassic", (example_class,), {"wrapper_paths": ("classic",)})()
    wrapper_cases = [(case_id, case) for case_id, case in smoke_cases if case.op in WRAPPER_OPS and case.op in EXAMPLE_OPS]
    assert {case.op for _, case in wrapper_cases} == set(WRAPPER_OPS) - set(MOE_WRAPPERS)
    not_passed = [
        (case_id, result.outcome.value, result.message)
        for case_id, case in wrapper_cases
        for result in [run_case(classic, case, case_id)]
        if result.outcome is not Outcome.PASS
    ]
    assert not_passed == []


# -- (c) one kernel removed: exactly its dependants are not supported ---------------------------------


def composed_kernels(op: str, path: str) -> set[str]:
    """The kernels the specs say wrapper op ``op`` calls in composition ``path`` (through its parts for an op
    composed of wrapper ops, ``add_lora_linear``)."""
    spec = OP_SPECS[op]
    if spec.composed_of:
        return set().union(*(composed_kernels(part, path) for part in spec.composed_of))
    return set(spec.compositions[path])


def dependants(kernel: str, paths: tuple[str, ...]) -> set[str]:
    """The ops unsupported once ``kernel`` is gone, by the specs: itself, every wrapper op none of whose
    compositions in ``paths`` does without it, and every op composed, at any depth, of one of those (a layer
    op of ``add_lora_linear``, itself of ``add_shrink`` and ``add_expand``)."""
    def needs(spec) -> bool:
        return not any(path in spec.compositions and kernel not in spec.compositions[path] for path in paths)

    gone = {op for op in WRAPPER_OPS if OP_SPECS[op].compositions and needs(OP_SPECS[op])}
    while more := {op for op in WRAPPER_OPS if set(OP_SPECS[op].composed_of) & gone} - gone:
        gone |= more
    return {kernel} | gone


def kernel_backed(op: str) -> tuple[str, ...]:
    """The wrapper ops with kernel compositions that ``op`` comes down to through its parts, at any depth."""
    parts = OP_SPECS[op].composed_of
    return tuple(leaf for part in parts for leaf in kernel_backed(part)) if parts else (op,)


def recording(base: type[KernelTarget], calls: list[str]) -> type[KernelTarget]:
    """``base`` with every kernel op noting its name in ``calls`` before it runs."""
    def noting(op: str):
        def kernel(self, *args):
            calls.append(op)
            return getattr(super(recorder, self), op)(*args)

        return kernel

    recorder = type(f"Recording{base.__name__}", (base,), {op: noting(op) for op in KERNEL_OPS})
    return recorder


def cases_reaching_every_kernel(smoke_cases, op: str) -> list[tuple[str, Case]]:
    """The cheapest prefill and decode cases of ``op`` with a row of an adapter (the classic composition
    calls the sgmv ops for one, the bgmv ops for the other)."""
    chosen = {}
    for case_id, case in sorted(smoke_cases, key=lambda pair: pair[1].num_tokens * pair[1].max_rank):
        if case.op == op and any(slot != -1 for slot in case.token_slots):
            chosen.setdefault(case.is_prefill, (case_id, case))
    return list(chosen.values())


COMPOSED_WRAPPERS = [op for op in WRAPPER_OPS if OP_SPECS[op].compositions or OP_SPECS[op].composed_of]


@pytest.mark.parametrize("path", COMPOSITIONS)
@pytest.mark.parametrize("op", COMPOSED_WRAPPERS)
def test_kernel_target_composes_each_wrapper_op_from_exactly_the_kernels_its_spec_names(smoke_cases, op, path):
    needed = composed_kernels(op, path)
    calls: list[str] = []
    only_those = {kernel: None for kernel in KERNEL_OPS if kernel not in needed}
    target = type("OnlyTheComposition", (recording(PlainTorchTarget, calls),), {**only_those, "wrapper_paths": (path,)})()
    assert op in target.implemented_ops() and set(target.derived_from(op)) == needed
    chosen = cases_reaching_every_kernel(smoke_cases, op)
    for case_id, case in chosen:
        assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS, case_id
    # each kernel it names is called by some case, and no other kernel; an op drawn in prefill only (the token
    # head: pooling batches are prefill) never reaches the classic path's decode kernels, the bgmv ops
    prefill_only = all(case.is_prefill for _, case in chosen)
    reached = {k for k in needed if not k.startswith("bgmv_")} if path == "classic" and prefill_only else needed
    assert set(calls) == reached


DEFAULT_ORDER = KernelTarget.wrapper_paths
COMPOSITION_ORDERS = [DEFAULT_ORDER, ("lora", "classic"), ("lora",), ("classic",), ("bgmv",), ("sgmv",), ("sgmv", "bgmv")]


def test_the_default_order_tries_vllms_wrappers_first_then_each_kernel_family():
    assert DEFAULT_ORDER == ("lora", "classic", "bgmv", "sgmv") and set(DEFAULT_ORDER) == set(COMPOSITIONS)
    with pytest.raises(ValueError, match=r"names \['gpu'\], which are no compositions"):
        type("Misspelt", (PlainTorchTarget,), {"wrapper_paths": ("gpu", "lora")})


@pytest.mark.parametrize("paths", COMPOSITION_ORDERS, ids="-".join)
@pytest.mark.parametrize("kernel", KERNEL_OPS)
def test_removing_one_kernel_makes_exactly_its_dependants_not_supported(cheapest_per_op, kernel, paths):
    # PlainTorchTarget defines all ten kernels (the example has no MoE kernels)
    without = type(f"Without_{kernel}", (PlainTorchTarget,), {kernel: None, "wrapper_paths": paths})()
    expected = dependants(kernel, paths)
    assert set(ALL_OPS) - set(without.implemented_ops()) == expected

    outcomes = {op: run_case(without, case, case_id).outcome for op, (case_id, case) in cheapest_per_op.items()}
    assert {op for op, outcome in outcomes.items() if outcome is Outcome.NOT_SUPPORTED} == expected
    assert {op for op, outcome in outcomes.items() if outcome is Outcome.PASS} == set(ALL_OPS) - expected

    description = describe_class(type(without))
    assert {s.op for s in description.statuses if not s.supported} == expected
    for op in expected - {kernel}:
        assert kernel in description.status(op, "bfloat16").status


def test_the_example_without_kernels_supports_nothing(example_class):
    bare = type("Bare", (example_class,), dict.fromkeys(KERNEL_OPS))()
    assert bare.implemented_ops() == ()


# -- (c'') one kernel family alone gives every dense wrapper method -------------------------------------

DENSE_WRAPPERS = tuple(op for op in WRAPPER_OPS if op not in MOE_WRAPPERS)
# A backend's kernel families, and the composition the default wrapper_paths gives each dense wrapper op from
# that family alone. The bgmv ops alone get the logits and the full linear by the classic composition: vLLM's
# CPU wrapper already sends the sampled rows to bgmv, so those two need nothing else there.
KERNEL_FAMILIES = {
    "bgmv": (("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"),
             {"add_lora_logits": "classic", "apply_lora_full_linear": "classic"}),
    "sgmv": (("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"), {}),
    "lora": (("lora_shrink", "lora_expand"), {}),
}  # fmt: skip


def only_family(base: type[KernelTarget], family: str, calls: list[str]) -> KernelTarget:
    """``base`` with only ``family``'s kernels (the others None), recording its kernel calls, default ``wrapper_paths``."""
    kernels, _ = KERNEL_FAMILIES[family]
    return type(f"Only_{family}", (recording(base, calls),), {op: None for op in KERNEL_OPS if op not in kernels})()


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_one_kernel_family_alone_gives_every_dense_wrapper_method(smoke_cases, family):
    kernels, elsewhere = KERNEL_FAMILIES[family]
    calls: list[str] = []
    target = only_family(PlainTorchTarget, family, calls)
    assert target.wrapper_paths == DEFAULT_ORDER
    assert target.implemented_ops() == kernels + DENSE_WRAPPERS
    assert {op: target.wrapper_path(op) for op in DENSE_WRAPPERS if OP_SPECS[op].compositions} == {
        op: elsewhere.get(op, family) for op in DENSE_WRAPPERS if OP_SPECS[op].compositions
    }
    assert all(set(target.derived_from(op)) <= set(kernels) for op in DENSE_WRAPPERS)
    # describe names each op's composition; an op made of wrapper ops, those of its parts
    described = describe_class(type(target))
    for op in DENSE_WRAPPERS:
        parts = OP_SPECS[op].composed_of
        used = tuple(dict.fromkeys(target.wrapper_path(part) for part in kernel_backed(op)))
        assert described.status(op, "bfloat16").composition == ", ".join(used)
        assert described.status(op, "bfloat16").status.endswith(" composition)" if parts else f"by the {used[0]} composition")
    # a prefill and a decode case of every dense wrapper op, each with a row of an adapter: all pass, and
    # between them they reach every kernel of the family and no other
    for op in DENSE_WRAPPERS:
        for case_id, case in cases_reaching_every_kernel(smoke_cases, op):
            assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS, case_id
    assert set(calls) == set(kernels)


@pytest.mark.slow  # every dense wrapper case of the smoke profile, three times over (a minute on two cores)
@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_one_kernel_family_alone_passes_every_dense_wrapper_smoke_case(smoke_cases, family):
    kernels, _ = KERNEL_FAMILIES[family]
    calls: list[str] = []
    target = only_family(PlainTorchTarget, family, calls)
    dense_cases = [(case_id, case) for case_id, case in smoke_cases if case.op in DENSE_WRAPPERS]
    assert {case.op for _, case in dense_cases} == set(DENSE_WRAPPERS)
    assert {case.is_prefill for _, case in dense_cases} == {True, False}
    not_passed = [
        (case_id, result.outcome.value, result.message)
        for case_id, case in dense_cases
        for result in [run_case(target, case, case_id, runs=1)]
        if result.outcome is not Outcome.PASS
    ]
    assert not_passed == []
    assert set(calls) == set(kernels)


class DropsTheSliceOffset(PlainTorchTarget):
    """A seeded bug: ``bgmv_expand_slice`` writes every slice from column 0, whatever ``slice_offset`` says."""

    name = "drops-the-slice-offset"

    def bgmv_expand_slice(self, inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True):
        super().bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, slice_size, add_inputs)


def test_a_bug_in_the_bgmv_kernels_fails_exactly_the_wrapper_ops_composed_from_them(smoke_cases):
    target = only_family(DropsTheSliceOffset, "bgmv", [])
    uses_it = {op for op in DENSE_WRAPPERS if "bgmv_expand_slice" in target.derived_from(op)}
    # the slices of add_expand and add_lora_linear, at running offsets, and the layer ops made of add_lora_linear
    assert uses_it == {"add_expand", "add_lora_linear", "grouped_lora_linear", "fp32_output_lora_linear"}
    # grouped_lora_linear expands each head group alone, one slice at column 0 of the group's copy: the bug's
    # offset is never anything but 0 there, so its cases pass
    shows_it = uses_it - {"grouped_lora_linear"}

    def offset_cases(op: str) -> list[tuple[str, Case]]:
        """The cheapest prefill and decode cases of ``op`` that expand a slice of an adapter's rows off column 0."""
        with_offset = [(i, c) for i, c in smoke_cases if c.offset_start > 0 or c.num_slices > 1]
        return cases_reaching_every_kernel(with_offset, op)

    for op in DENSE_WRAPPERS:
        chosen = offset_cases(op) if op in uses_it else cases_reaching_every_kernel(smoke_cases, op)
        # a prefill and a decode case where the smoke list has both (the layer ops' few cases may be one phase)
        phases = {case.is_prefill for _, case in smoke_cases if case.op == op}
        assert {case.is_prefill for _, case in chosen} == phases or op == "token_classification_head", op
        outcomes = {run_case(target, case, case_id, runs=1).outcome for case_id, case in chosen}
        assert outcomes == ({Outcome.FAIL} if op in shows_it else {Outcome.PASS}), op


# -- (c') the MoE wrapper ops: which kernels they call, and how -----------------------------------------


class KernelCalls(PlainTorchTarget):
    """PlainTorchTarget recording the arguments of each MoE kernel call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def fused_moe_lora(self, *args):
        self.calls.append(("fused_moe_lora", args))
        super().fused_moe_lora(*args)

    def moe_lora_align_block_size(self, *args):
        self.calls.append(("moe_lora_align_block_size", args))
        super().moe_lora_align_block_size(*args)


def _first_case(smoke_cases, op: str, **fields) -> tuple[str, Case]:
    return next(
        (case_id, case)
        for case_id, case in smoke_cases
        if case.op == op and any(s != -1 for s in case.token_slots) and all(getattr(case, k) == v for k, v in fields.items())
    )


@pytest.mark.parametrize("op", MOE_WRAPPERS)
def test_the_lora_composition_aligns_with_the_targets_own_kernel_then_walks_the_blocks(smoke_cases, op):
    case_id, case = _first_case(smoke_cases, op)
    target = KernelCalls()
    assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS
    (align, align_args), (fused, fused_args) = target.calls
    assert (align, fused) == ("moe_lora_align_block_size", "fused_moe_lora")
    sorted_ids, expert_ids, padded = align_args[7:10]
    assert fused_args[5].data_ptr() == sorted_ids.data_ptr() and fused_args[6].data_ptr() == expert_ids.data_ptr()
    assert fused_args[7] is padded and fused_args[14] == target.moe_block_size  # shrink_block_size_m
    assert fused_args[28] is (op == "add_lora_w2")  # mul_routed_weight


@pytest.mark.parametrize("path", [path for path in COMPOSITIONS if path != "lora"])
def test_every_composition_but_lora_gives_the_kernel_each_pairs_local_expert(smoke_cases, path):
    case_id, case = _first_case(smoke_cases, "add_lora_w2", family="moe_nonlocal")
    target = type("Naive", (KernelCalls,), {"wrapper_paths": (path, "lora")})()  # lora would win were it first
    assert target.wrapper_path("add_lora_w2") == path
    assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS
    ((name, args),) = target.calls
    sorted_ids, expert_ids, padded = args[5:8]
    assert name == "fused_moe_lora" and sorted_ids is None and padded is None
    local = [case.local_expert(e) for ids in case.topk_ids for e in ids]
    assert expert_ids.tolist() == local and -1 in local  # experts on another rank: −1, which the kernel skips


@pytest.mark.parametrize("op", MOE_WRAPPERS)
def test_shared_stacks_reach_the_kernel_expanded_with_stride_0(smoke_cases, op):
    case_id, case = _first_case(smoke_cases, op, shared_experts=True)
    target = KernelCalls()
    assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS
    ((_, args),) = [call for call in target.calls if call[0] == "fused_moe_lora"]
    shared = args[2] if op == "add_lora_w13" else args[3]  # w13 shares LoRA-A, w2 LoRA-B
    per_expert = args[3] if op == "add_lora_w13" else args[2]
    assert all(stack.size(1) == case.num_experts and stack.stride(1) == 0 for stack in shared)
    assert all(stack.size(1) == case.num_experts and stack.stride(1) != 0 for stack in per_expert)


def test_no_moe_kernel_runs_when_every_token_has_slot_minus_1(smoke_cases):
    case_id, case = next((i, c) for i, c in smoke_cases if c.op == "add_lora_w13" and set(c.token_slots) == {-1})
    target = KernelCalls()
    assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS
    assert target.calls == []


class ReferenceMoEKernels(KernelTarget):
    """The MoE wrapper ops composed by KernelTarget from the reference's own MoE kernels."""

    name = "reference-moe-kernels"
    fused_moe_lora = staticmethod(reference.fused_moe_lora)
    moe_lora_align_block_size = staticmethod(reference.moe_lora_align_block_size)


@pytest.mark.parametrize("paths", [("lora",), ("classic",)], ids="-".join)  # bgmv and sgmv: the same naive form as classic
def test_the_moe_compositions_of_the_reference_kernels_pass_every_moe_wrapper_case(smoke_cases, paths):
    """Composed from the reference's kernels, the derivation itself is judged: the naive path's local
    experts (−1 off this rank) must mean what the reference wrapper means."""
    target = type("Composed", (ReferenceMoEKernels,), {"wrapper_paths": paths})()
    moe_cases = [(case_id, case) for case_id, case in smoke_cases if case.op in MOE_WRAPPERS]
    assert {case.family for _, case in moe_cases} >= {"moe_nonlocal", "moe_shared", "moe_disabled"}
    results = [run_case(target, case, case_id) for case_id, case in moe_cases]
    assert [(r.case_id, r.outcome.value, r.message) for r in results if r.outcome is not Outcome.PASS] == []



# -- the vendor's wrapper methods win ------------------------------------------------------------------


def test_a_wrapper_method_the_vendor_defines_wins_over_the_derived_one(example_class, cheapest_per_op):
    calls = []

    class Vendor(example_class):
        lora_shrink = None
        sgmv_shrink = None  # no kernel path left for add_shrink: only the vendor's method

        def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
            calls.append("add_shrink")
            helper = type("Helper", (example_class,), {})()
            helper.update_metadata(self.mapping)
            helper.add_shrink(y, x, lora_a_stacked, scale, **kwargs)

        def add_expand(self, *args, **kwargs):
            calls.append("add_expand")
            super().add_expand(*args, **kwargs)

    target = Vendor()
    assert {"add_shrink", "add_expand", "add_lora_linear"} <= set(target.implemented_ops())
    assert target.derived_from("add_shrink") == () and target.derived_from("add_expand") == ()
    case_id, case = cheapest_per_op["add_lora_linear"]
    assert case.seq_slots != (-1,) * len(case.seq_slots)
    assert run_case(target, case, case_id, runs=1).outcome is Outcome.PASS
    assert calls == ["add_shrink", "add_expand"]

    described = describe_class(Vendor)
    assert described.status("add_shrink", "float16").status == "implemented"
    assert described.status("add_expand", "float16").status == "implemented"
    assert described.status("add_lora_linear", "float16").status.startswith("derived from add_shrink, add_expand (implemented)")
    assert described.status("add_lora_logits", "float16").status == "derived from kernels (bgmv_shrink, bgmv_expand) by the classic composition"
    assert described.status("add_lora_linear", "float16").composition is None  # both parts are the vendor's


def test_update_metadata_feeds_the_derived_methods(example_class, cheapest_per_op):
    target = example_class()
    _, case = cheapest_per_op["add_shrink"]
    target.update_metadata(case_mapping(case))
    assert target.token_indices.tolist() == list(case.token_slots)


# -- (d) describe --------------------------------------------------------------------------------------


def describe_lines(name: str) -> dict[tuple[str, str], str]:
    """``python -m conformance.targets describe NAME``, as ``(op, dtype) → status``."""
    completed = run_command("-m", "conformance.targets", "describe", name)
    assert completed.returncode == 0, completed.stderr[-2000:]
    statuses = {}
    for line in completed.stdout.splitlines():
        match = re.match(r"^(\w+)\s+(kernel|wrapper)\s+(float16|bfloat16|float32)\s+(.+)$", line)
        if match:
            statuses[match[1], match[3]] = match[4]
    assert set(statuses) == {(op, dtype) for op in ALL_OPS for dtype in DTYPES}, completed.stdout
    return statuses


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_describe_the_example_backend(example_class):
    statuses = describe_lines("plain-example")
    no_moe_kernels = (
        "not supported: missing kernels moe_lora_align_block_size and fused_moe_lora (lora composition) "
        "or fused_moe_lora (classic, bgmv or sgmv composition)"
    )
    derived = {
        "add_shrink": "derived from kernels (lora_shrink) by the lora composition",
        "add_expand": "derived from kernels (lora_expand) by the lora composition",
        "add_lora_linear": "derived from kernels (lora_shrink, lora_expand) via add_shrink (lora composition) then add_expand (lora composition)",
        "add_lora_embedding": "derived from kernels (lora_expand) by the lora composition",
        "add_lora_logits": "derived from kernels (lora_shrink, lora_expand) by the lora composition",
        "apply_lora_full_linear": "derived from kernels (lora_shrink) by the lora composition",
        "token_classification_head": "derived from kernels (lora_shrink) via add_shrink (lora composition)",
        # vLLM 0.34's layer ops, through the wrapper ops they call (add_lora_linear: add_shrink then add_expand)
        "grouped_lora_linear": "derived from kernels (lora_shrink, lora_expand) via add_lora_linear (lora composition)",
        "fp32_output_lora_linear": "derived from kernels (lora_shrink, lora_expand) via add_lora_linear (lora composition)",
        "scaled_embedding_lora": "derived from kernels (lora_expand) via add_lora_embedding (lora composition)",
        # the example's own reason, where it gives one (PlainExampleTarget.why_not_implemented)
        **{op: "not supported: " + example_class.why_not_implemented.get(op, f"plain-example does not define {op}") for op in MOE_KERNELS},
        "add_lora_w13": no_moe_kernels,
        "add_lora_w2": no_moe_kernels,
    }
    for (op, dtype), status in statuses.items():
        assert status == derived.get(op, "implemented"), (op, dtype)


@pytest.mark.slow
def test_describe_the_vllm_cpu_target():
    statuses = describe_lines("cpu")
    for (op, dtype), status in statuses.items():
        if op in ("lora_shrink", "lora_expand") or op in MOE_OPS + FP8_OPS:  # Triton-only; vLLM's CPU wrapper has no MoE LoRA
            assert status.startswith("not supported: ") and op in status, status  # the reason names the op
        elif op in ("add_expand", "add_lora_linear"):
            assert status.startswith("implemented; cases with LoRA bias not supported: "), status
        elif op in VLLM_034_LAYERS and vllm_release() < (0, 34):  # the layer's code is vLLM 0.34's: named, with its file
            assert status == f"not supported: the installed vLLM {vllm_version()} predates {VLLM_034_LAYERS[op]}, added in vLLM 0.34", status
        else:
            assert status == "implemented", (op, dtype, status)


def test_describe_names_missing_kernels_dtypes_and_opt_outs(example_class):
    import torch

    class Partial(example_class):
        name = "partial"
        dtypes = frozenset({torch.bfloat16})
        wrapper_paths = ("classic", "lora")
        lora_expand = None
        bgmv_expand_slice = None
        add_lora_logits = None

    described = describe_class(Partial)
    assert described.status("bgmv_shrink", "float32").status == "not supported: float32 is not in partial's dtypes (bfloat16)"
    assert described.status("lora_expand", "bfloat16").status == "not supported: partial does not define lora_expand"
    assert described.status("add_expand", "bfloat16").status == (
        "not supported: missing kernels bgmv_expand_slice (classic composition) or lora_expand (lora composition)"
    )
    assert described.status("add_lora_linear", "bfloat16").status.startswith("not supported: needs add_expand, which is missing")
    assert described.status("add_lora_logits", "bfloat16").status == "not supported: partial sets add_lora_logits to None (opted out)"
    assert described.status("add_shrink", "bfloat16").status == "derived from kernels (sgmv_shrink, bgmv_shrink) by the classic composition"
    assert described.status("add_lora_embedding", "bfloat16").status == "derived from kernels (sgmv_expand, bgmv_expand) by the classic composition"
    assert described.status("add_shrink", "bfloat16").composition == "classic"
    assert described.status("add_expand", "bfloat16").composition is None
    assert described.status("add_lora_w13", "bfloat16").status == (
        "not supported: missing kernels fused_moe_lora (classic composition) or moe_lora_align_block_size and "
        "fused_moe_lora (lora composition)"
    )


def test_describe_says_which_moe_composition_a_backend_gets():
    naive = describe_class(type("NaiveMoE", (PlainTorchTarget,), {"name": "naive-moe", "moe_lora_align_block_size": None}))
    assert naive.status("add_lora_w2", "float16").status == "derived from kernels (fused_moe_lora) by the classic composition"
    assert naive.status("moe_lora_align_block_size", "float16").status == "not supported: naive-moe does not define moe_lora_align_block_size"
    aligned = describe_class(PlainTorchTarget)
    assert aligned.status("add_lora_w13", "float16").status == (
        "derived from kernels (moe_lora_align_block_size, fused_moe_lora) by the lora composition"
    )


def test_describe_a_target_that_cannot_run_here(example_class):
    class Elsewhere(example_class):
        name = "elsewhere"

        @classmethod
        def check_available(cls):
            raise TargetUnavailable("target 'elsewhere' needs the mychip runtime, which is not installed")

    described = describe_class(Elsewhere)
    assert not described.usable and "mychip" in described.reason
    assert not any(s.supported for s in described.statuses)
    assert described.status("add_shrink", "float16").status == (
        "not supported: elsewhere cannot run here (see above); as defined: derived from kernels (lora_shrink) by the lora composition"
    )


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_describe_an_unknown_target_exits_listing_the_known_ones():
    completed = run_command("-m", "conformance.targets", "describe", "no-such-target")
    assert completed.returncode == 2
    assert "unknown target 'no-such-target'" in completed.stderr and "plain-example" in completed.stderr
