"""The bring-up kit: a backend implements the kernels, the suite does the rest.

* the example out-of-tree backend (``examples/plain-lora-backend``, installed by
  ``scripts/install-cpu-env``) is registered as ``plain-example`` and passes the smoke gate with
  nothing "not supported", run as a vendor runs it (pytest in a subprocess; serial, as ``-n 2`` was
  measured slower for this one: 29 s against 18 s on two cores);
* its kernels also carry the wrapper level composed like vLLM's CPU wrapper (sgmv / bgmv);
* removing one kernel makes exactly the ops that ``KernelTarget``'s docstring table says depend on it
  "not supported", for each composition order;
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

from conformance.cases import Case
from conformance.generator.profiles import profile_cases
from conformance.ops import case_mapping
from conformance.runner import run_case
from conformance.targets import KERNEL_OPS, WRAPPER_OPS, TargetUnavailable, kernel_target, known_targets, resolve
from conformance.targets.describe import describe_class
from conformance.targets.kernel_target import KernelTarget
from conformance.verdict import Outcome

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plain-lora-backend"
ALL_OPS = KERNEL_OPS + WRAPPER_OPS
DTYPES = ("float16", "bfloat16", "float32")


@pytest.fixture(scope="module")
def example_class():
    """``PlainExampleTarget``, or a failure saying how to install the example (CI installs it)."""
    try:
        from plain_lora_backend import PlainExampleTarget
    except ImportError:
        pytest.fail(
            "the example backend is not installed: pip install --no-deps -e examples/plain-lora-backend "
            "(scripts/install-cpu-env does it)"
        )
    return PlainExampleTarget


@pytest.fixture(scope="module")
def smoke_cases() -> list[tuple[str, Case]]:
    return profile_cases("smoke")


@pytest.fixture(scope="module")
def cheapest_per_op(smoke_cases) -> dict[str, tuple[str, Case]]:
    def cost(case: Case) -> int:
        return case.num_tokens * max(case.hidden_size, case.output_width) * case.max_rank * case.num_slices

    cheapest: dict[str, tuple[str, Case]] = {}
    for case_id, case in sorted(smoke_cases, key=lambda pair: cost(pair[1])):
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
    assert target.kernel_ops() == KERNEL_OPS
    assert not [op for op in WRAPPER_OPS if target.overrides(op)]
    assert target.implemented_ops() == ALL_OPS
    source = "\n".join(path.read_text() for path in (EXAMPLE / "plain_lora_backend").glob("*.py"))
    assert "conformance.reference" not in source and "from conformance import reference" not in source


@pytest.mark.slow
def test_the_example_passes_the_smoke_gate_with_nothing_unsupported(example_class, tmp_path):
    completed = run_command(
        "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--target=plain-example", "--profile=smoke",
        "--report-dir", str(tmp_path),
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    counts = report["gate"]["counts"]
    assert report["gate"]["passed"]
    assert counts["pass"] == len(report["results"]) > 500, counts
    assert counts["fail"] == counts["broken"] == counts["not supported"] == counts["known failure"] == 0
    op_results = [r for r in report["results"] if r["level"] != "model"]
    assert {r["op"] for r in op_results} == set(ALL_OPS)
    # end to end too: the suite's decoder runs on the wrapper methods composed from the kernels
    model = {r["op"] for r in report["results"] if r["level"] == "model"}
    assert model == {"teacher_forced_logits", "greedy_generation", "batch_invariance"}


# -- (b) kernels only also carry the wrapper level composed from the classic ops ----------------------


def test_the_example_kernels_pass_every_wrapper_smoke_case_through_the_classic_ops(example_class, smoke_cases):
    classic = type("PlainExampleClassic", (example_class,), {"wrapper_paths": ("classic",)})()
    wrapper_cases = [(case_id, case) for case_id, case in smoke_cases if case.op in WRAPPER_OPS]
    assert {case.op for _, case in wrapper_cases} == set(WRAPPER_OPS)
    not_passed = [
        (case_id, result.outcome.value, result.message)
        for case_id, case in wrapper_cases
        for result in [run_case(classic, case, case_id)]
        if result.outcome is not Outcome.PASS
    ]
    assert not_passed == []


# -- (c) one kernel removed: exactly its dependants are not supported ---------------------------------


def documented_kernels() -> dict[str, dict[str, set[str]]]:
    """KernelTarget's docstring table, read as data: composition → wrapper op → the kernels it needs."""
    table = kernel_target.__doc__.split("Which kernels each wrapper op needs")[1]
    needs: dict[str, dict[str, set[str]]] = {"lora": {}, "classic": {}}
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 3 and cells[0] in WRAPPER_OPS and cells[0] != "add_lora_linear":
            op, lora, classic = cells
            needs["lora"][op] = set(lora.split(" and "))
            needs["classic"][op] = set(classic.split(" and "))
    assert set(needs["lora"]) == set(WRAPPER_OPS) - {"add_lora_linear"}, "the docstring table changed shape"
    assert "add_lora_linear" in table and "``add_shrink`` then ``add_expand``" in table
    return needs


def documented_dependants(kernel: str, paths: tuple[str, ...]) -> set[str]:
    """The ops unsupported once ``kernel`` is gone: itself, every wrapper op none of whose compositions
    in ``paths`` does without it, and add_lora_linear when add_shrink or add_expand is among them."""
    needs = documented_kernels()
    gone = {op for op in needs["lora"] if all(kernel in needs[path][op] for path in paths)}
    if gone & {"add_shrink", "add_expand"}:
        gone.add("add_lora_linear")
    return {kernel} | gone


def test_the_docstring_table_is_the_table_kernel_target_uses():
    needs = documented_kernels()
    for path, ops in kernel_target.KERNELS_NEEDED.items():
        assert {op: set(kernels) for op, kernels in ops.items()} == needs[path]


COMPOSITION_ORDERS = [("lora", "classic"), ("lora",), ("classic",)]


@pytest.mark.parametrize("paths", COMPOSITION_ORDERS, ids="-".join)
@pytest.mark.parametrize("kernel", KERNEL_OPS)
def test_removing_one_kernel_makes_exactly_its_dependants_not_supported(example_class, cheapest_per_op, kernel, paths):
    without = type(f"Without_{kernel}", (example_class,), {kernel: None, "wrapper_paths": paths})()
    expected = documented_dependants(kernel, paths)
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
    assert run_case(target, case, case_id).outcome is Outcome.PASS
    assert calls == ["add_shrink", "add_expand"]

    described = describe_class(Vendor)
    assert described.status("add_shrink", "float16").status == "implemented"
    assert described.status("add_expand", "float16").status == "implemented"
    assert described.status("add_lora_linear", "float16").status.startswith("derived from add_shrink, add_expand (implemented)")
    assert described.status("add_lora_logits", "float16").status == "derived from kernels (bgmv_shrink, bgmv_expand)"


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


def test_describe_the_example_backend(example_class):
    statuses = describe_lines("plain-example")
    derived = {
        "add_shrink": "derived from kernels (lora_shrink)",
        "add_expand": "derived from kernels (lora_expand)",
        "add_lora_linear": "derived from kernels (lora_shrink, lora_expand) via add_shrink then add_expand",
        "add_lora_embedding": "derived from kernels (lora_expand)",
        "add_lora_logits": "derived from kernels (lora_shrink, lora_expand)",
    }
    for (op, dtype), status in statuses.items():
        assert status == derived.get(op, "implemented"), (op, dtype)


@pytest.mark.slow
def test_describe_the_vllm_cpu_target():
    statuses = describe_lines("cpu")
    for (op, dtype), status in statuses.items():
        if op in ("lora_shrink", "lora_expand"):
            assert status == f"not supported: cpu does not define {op}"
        elif op in ("add_expand", "add_lora_linear"):
            assert status.startswith("implemented; cases with LoRA bias not supported: "), status
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
    assert described.status("add_shrink", "bfloat16").status == "derived from kernels (sgmv_shrink, bgmv_shrink)"
    assert described.status("add_lora_embedding", "bfloat16").status == "derived from kernels (sgmv_expand, bgmv_expand)"


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
        "not supported: elsewhere cannot run here (see above); as defined: derived from kernels (lora_shrink)"
    )


def test_describe_an_unknown_target_exits_listing_the_known_ones():
    completed = run_command("-m", "conformance.targets", "describe", "no-such-target")
    assert completed.returncode == 2
    assert "unknown target 'no-such-target'" in completed.stderr and "plain-example" in completed.stderr
