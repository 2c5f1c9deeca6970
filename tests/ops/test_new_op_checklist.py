"""What still changes, by design, when a built-in op is added: the checklist.

An op is its spec and its reference function (``tests/ops/test_one_place_per_op.py``); the op lists, the
``reference`` target, ``describe``, the generator and the runner derive from the registry. What cannot
derive from it is what an implementation says about the op, so adding a built-in op (a name in
``conformance.ops.OP_NAMES``) still touches these places, each of which must *implement the op or say
why not*:

1. every built-in target (``conformance/targets/registry.py``, ``BUILTIN_TARGETS``): it defines the op,
   or names the reason in ``why_not_implemented`` (what ``describe`` and the report show for the op's
   cases; without it they only say "does not define"). A ``KernelTarget``'s wrapper op that its
   kernels cannot compose is explained by ``describe`` from the missing kernels, which counts;
2. the test doubles (``tests/fault_targets.py``): the seeded faults are one per *class of bug*
   (``FAULTS``, ``UNCAUGHT_BY_DESIGN``), not one per op, so no op needs a fault of its own; what is per
   op is ``PlainTorchTarget``, the independent correct target every fault is a one-method change of,
   which ``tests/verdict/test_fault_catalog.py`` requires to implement every op (or it lists the op in
   its ``why_not_implemented``). The other doubles derive from ``HpuEmulatedTarget`` or
   ``ReferenceTarget`` and follow them;
3. the example backend (``examples/plain-lora-backend``, ``PlainExampleTarget``): it implements the
   op, or lists it as deliberately left out in its ``why_not_implemented``.

A target that cannot run here is judged by what its class defines (as ``describe`` does); a built-in
target whose class cannot even be imported is not judged. Each gap names the file to change and what to
add.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_targets import PlainTorchTarget

from conformance.ops import OP_NAMES, OP_SPECS, Level, ops_at, register, unregister
from conformance.targets.base import Target, TargetError, TargetUnavailable
from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.targets.kernel_target import KernelTarget
from conformance.targets.registry import BUILTIN_TARGETS, resolve

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_INSTALL = "pip install --no-deps -e examples/plain-lora-backend (scripts/install-cpu-env does it)"

BUILT_IN, TEST_DOUBLE, EXAMPLE = "built-in target", "test double", "example backend"


@dataclass(frozen=True)
class Place:
    """One implementation the checklist reads: a name, its class, and which kind of place it is."""

    name: str
    cls: type[Target]
    kind: str


@dataclass(frozen=True)
class Gap:
    """A place that neither implements an op nor says why: the file to change and what to add there."""

    place: str
    op: str
    file: str
    message: str


def source_file(cls: type) -> str:
    """Where ``cls`` is defined, relative to the repository when it lies inside it."""
    path = Path(inspect.getsourcefile(cls)).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def built_in_places() -> list[Place]:
    """Every built-in target whose class can be imported here."""
    places = []
    for name in BUILTIN_TARGETS:
        try:
            places.append(Place(name, resolve(name), BUILT_IN))
        except TargetError:
            continue  # its module cannot be imported here: nothing to read
    return places


def default_places() -> list[Place]:
    try:
        from plain_lora_backend import PlainExampleTarget
    except ImportError:
        pytest.fail(f"the example backend is not installed, so the checklist cannot read it: {EXAMPLE_INSTALL}")
    return [*built_in_places(), Place("plain-torch", PlainTorchTarget, TEST_DOUBLE), Place("plain-example", PlainExampleTarget, EXAMPLE)]


@functools.cache
def instance(cls: type[Target]) -> Target:
    """The target as ``describe`` sees it: constructed where it can run here (some bind their ops when
    constructed, e.g. ``cpu`` binds vLLM's torch ops), else only what its class defines."""
    try:
        return cls()
    except TargetUnavailable:
        return cls.__new__(cls)


def kernel_target_composes(op: str) -> bool:
    """Whether ``KernelTarget`` derives wrapper op ``op`` from kernels: asked of a subclass that has them all."""

    def kernel(*args, **kwargs):
        raise AssertionError("never called: only which ops exist is asked")

    every_kernel = type("EveryKernel", (KernelTarget,), dict.fromkeys(ops_at(Level.KERNEL), kernel))
    return op in every_kernel().implemented_ops()


def says_why_not(target: Target, op: str) -> bool:
    """Whether the target gives a reason of its own for not implementing ``op``."""
    if op in target.why_not_implemented:
        return True
    # describe explains a KernelTarget's wrapper op by the kernels its composition lacks, unless the
    # subclass opted out of it (``op = None``) or KernelTarget cannot compose the op at all
    if not isinstance(target, KernelTarget) or OP_SPECS[op].level != Level.WRAPPER:
        return False
    return callable(getattr(type(target), op, None)) and kernel_target_composes(op)


def where_ops_live(cls: type[Target], level: Level) -> type | None:
    """The class in ``cls``'s hierarchy that defines its built-in ops of ``level`` (where a new one goes)."""
    for klass in cls.__mro__:
        own = vars(klass)
        if klass not in (Target, KernelTarget, object) and any(callable(own.get(op)) for op in OP_NAMES if OP_SPECS[op].level == level):
            return klass
    return None


def gap_message(place: Place, op: str) -> str:
    cls, level = place.cls, OP_SPECS[op].level
    file, owner = source_file(cls), where_ops_live(cls, level)
    where = f"to {owner.__name__} in {source_file(owner)}, next to its other {level.value} ops" if owner else f"to {cls.__name__}"
    implement = f"add the {level.value} op {op} (the signature of the spec's reference function) {where}"
    if issubclass(cls, KernelTarget) and level == Level.WRAPPER:
        implement += ", or let KernelTarget compose it from kernels (conformance/targets/kernel_target.py)"
    decline = f"add {op!r}: \"<why not>\" to {cls.__name__}.why_not_implemented in {file}"
    if place.kind == TEST_DOUBLE:
        return (f"{file}: {cls.__name__} ({place.name}) does not implement {op}. Every seeded fault is a one-method change "
                f"of this correct target, and tests/verdict/test_fault_catalog.py::test_plain_torch_implements_every_op "
                f"requires every op: {implement}; or, to leave it out deliberately, {decline} (and leave {op} out of that test)")
    if place.kind == EXAMPLE:
        return (f"{file}: the example backend ({place.name}) neither implements {op} nor lists it as deliberately left "
                f"out: {implement}; or {decline} (describe shows it as the reason)")
    return (f"{file}: {cls.__name__} ({place.name}) neither implements {op} nor says why not: {implement}; or {decline} "
            f"(describe and the report show it as the reason of the op's cases)")


def checklist(ops: tuple[str, ...], places: list[Place] | None = None) -> list[Gap]:
    """Every place that neither implements one of ``ops`` nor says why not."""
    gaps = []
    for place in default_places() if places is None else places:
        target = instance(place.cls)
        implemented = set(target.implemented_ops())
        for op in ops:
            if op not in implemented and not says_why_not(target, op):
                gaps.append(Gap(place.name, op, source_file(place.cls), gap_message(place, op)))
    return gaps


# -- the checklist on the built-in ops -----------------------------------------------------------


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_place_implements_the_op_or_says_why_not(op):
    gaps = checklist((op,))
    assert not gaps, f"{len(gaps)} place(s) to change for {op}:\n" + "\n".join(gap.message for gap in gaps)


# -- the checklist can fail: a silent gap is reported, a stated reason is accepted ----------------------


def test_a_target_that_silently_lacks_an_op_is_reported_and_a_reason_accepted():
    silent = type("HpuEmulatedWithoutBgmvShrink", (HpuEmulatedTarget,), {"bgmv_shrink": None})
    declined = type("HpuEmulatedDecliningBgmvShrink", (silent,), {"why_not_implemented": {"bgmv_shrink": "a test's reason"}})
    places = [Place("hpu-emulated", silent, BUILT_IN), Place("hpu-emulated-declining", declined, BUILT_IN)]
    gaps = checklist(OP_NAMES, places)
    assert [(gap.place, gap.op) for gap in gaps] == [("hpu-emulated", "bgmv_shrink")]
    message = gaps[0].message
    assert message.startswith(f"{source_file(silent)}: HpuEmulatedWithoutBgmvShrink (hpu-emulated) neither implements bgmv_shrink")
    # where the op would go (the class holding the HPU kernel ops), and the reason it could state instead
    assert "HpuKernelOps in conformance/targets/hpu/kernels.py" in message and ".why_not_implemented" in message


def test_a_kernel_target_wrapper_op_is_explained_by_its_missing_kernels_unless_it_opts_out():
    no_moe = type("NoMoE", (PlainTorchTarget,), {"fused_moe_lora": None, "moe_lora_align_block_size": None})
    opted_out = type("OptedOut", (PlainTorchTarget,), {"add_lora_logits": None})
    gaps = checklist(OP_NAMES, [Place("no-moe", no_moe, TEST_DOUBLE), Place("opted-out", opted_out, TEST_DOUBLE)])
    # the MoE wrapper ops are explained by describe ("missing kernels …"); the kernels and the opt-out are not
    assert {(gap.place, gap.op) for gap in gaps} == {
        ("no-moe", "fused_moe_lora"), ("no-moe", "moe_lora_align_block_size"), ("opted-out", "add_lora_logits"),
    }
    assert all("test_plain_torch_implements_every_op" in gap.message for gap in gaps)


# -- adding a built-in op: the checklist names exactly the places to change ----------------------------


def expected_places(level: Level) -> set[tuple[str, str]]:
    """Where a new op of ``level`` must go: every place but the reference target, which serves any op from
    its spec (a built-in target whose class cannot be imported here is not judged)."""
    hpu_targets = ("hpu", "hpu-gather", "hpu-emulated", "hpu-emulated-gather")
    places = {
        ("cpu", "conformance/targets/vllm_cpu.py"),
        ("cuda", "conformance/targets/vllm_cuda.py"),
        *((name, "conformance/targets/hpu/targets.py") for name in hpu_targets),
        ("vllm-hpu", "conformance/targets/hpu/vllm_gaudi.py"),
        ("plain-torch", "tests/fault_targets.py"),
        ("plain-example", "examples/plain-lora-backend/plain_lora_backend/target.py"),
    }
    importable = {place.name for place in built_in_places()} | {"plain-torch", "plain-example"}
    return {(name, file) for name, file in places if name in importable}


@pytest.mark.parametrize(("like", "name"), [("bgmv_shrink", "new_kernel_op"), ("add_shrink", "new_wrapper_op")])
def test_adding_a_built_in_op_names_exactly_the_places_to_change(like, name):
    spec = dataclasses.replace(OP_SPECS[like], name=name)  # its own math does not matter to the checklist
    register(spec)
    try:
        assert name in ops_at(spec.level)
        gaps = checklist((*OP_NAMES, name))
    finally:
        unregister(name)
    assert {gap.op for gap in gaps} == {name}  # the built-in ops stay covered
    assert {(gap.place, gap.file) for gap in gaps} == expected_places(spec.level)
    for gap in gaps:
        assert gap.message.startswith(f"{gap.file}: ") and name in gap.message and "why_not_implemented" in gap.message
    by_place = {gap.place: gap.message for gap in gaps}
    if spec.level == Level.KERNEL:  # where each target keeps its kernel ops
        assert "to HpuKernelOps in conformance/targets/hpu/kernels.py" in by_place["hpu-emulated"]
        assert "to PlainTorchTarget in tests/fault_targets.py" in by_place["plain-torch"]
    else:  # a KernelTarget's wrapper op can also come from KernelTarget's compositions
        assert "conformance/targets/kernel_target.py" in by_place["plain-example"]
        assert "to HpuPunicaWrapper in conformance/targets/hpu/wrapper.py" in by_place["hpu-emulated"]
