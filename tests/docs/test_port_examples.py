"""docs/ports.md's examples are the files under examples/ports/, they pass, and they cannot pass without what they show.

* every ``<!-- example: FILE -->`` block of the page is that file verbatim, every file is shown, and each is
  followed by a command that the suite's own command line accepts, naming a class of that file;
* (integration) each documented command, run as written (plus ``--report-dir``), passes through the real
  worker: every case it selects passes, each op it names at least once, and nothing fails or breaks (a
  case the example declares not supported, LoRA bias, is the only other outcome allowed);
* each example without the feature it shows (the suite's copy of a functional result, its call context,
  its reading of a returned ``y``, its ``construct_wrapper``, its ``token_lora_slots``, its adapter's
  declared result) fails or breaks a case of its command that it passes with it, in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from suite_commands import check, suite_commands

from conformance.caselists.caselist import load_caselist
from conformance.cases import Case
from conformance.query import matching, parse_query
from conformance.runner import run_case
from conformance.targets.kernel_adapter import adapt
from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget
from conformance.verdict import Outcome

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "ports.md"
EXAMPLES = ROOT / "examples" / "ports"
EXAMPLE = re.compile(r"<!-- example: (examples/ports/[a-z_]+\.py) -->\n```python\n(.*?)\n```\n+```bash\n(.*?)\n```", re.S)

sys.path.insert(0, str(EXAMPLES))  # as the documented PYTHONPATH=examples/ports
# Imported at collection: the wrapper examples import vLLM, whose first import runs `file` (cpuinfo), a process a
# unit test may not start (tests/conftest.py).
import port_call_context  # noqa: E402
import port_functional  # noqa: E402
import port_kernel_adapter  # noqa: E402

try:
    import port_returned_result
    import port_token_slots
    import port_wrapper_sizing
    import vllm.config.lora  # the wrapper targets' LoRAConfig and LoRAMapping, imported now for the same reason
    import vllm.lora.layers  # noqa: F401
except ImportError as exc:  # no vLLM: the wrapper examples' tests say so
    MISSING_VLLM = str(exc)
else:
    MISSING_VLLM = None


def documented() -> dict[str, tuple[str, list[str]]]:
    """Each example's file name → (the code block, the command's arguments after ``pytest``)."""
    found = {}
    for path, code, command in EXAMPLE.findall(PAGE.read_text()):
        [(program, arguments)] = suite_commands(command)
        assert program == "pytest", command
        found[Path(path).name] = (code, arguments)
    return found


DOCUMENTED = documented()
WRAPPER_EXAMPLES = {"port_returned_result.py", "port_token_slots.py", "port_wrapper_sizing.py"}


def test_every_example_is_shown_verbatim_with_a_command_the_suite_accepts():
    files = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert sorted(DOCUMENTED) == files, "docs/ports.md shows each file of examples/ports/ once, with its command"
    for name, (code, arguments) in DOCUMENTED.items():
        assert code == (EXAMPLES / name).read_text().rstrip("\n"), f"docs/ports.md's block of {name} differs from the file"
        parsed = check("pytest", arguments)
        module, _, cls = parsed.target.partition(":")
        assert module == name.removesuffix(".py") and f"\nclass {cls}(" in (EXAMPLES / name).read_text(), parsed.target
        assert parsed.caselist == "smoke" and parsed.cases, arguments


# -- each documented command, through the real worker ------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_the_documented_command_passes_through_the_worker(name, tmp_path):
    if MISSING_VLLM and name in WRAPPER_EXAMPLES:
        pytest.skip(f"the wrapper examples need vLLM: {MISSING_VLLM}")
    _, arguments = DOCUMENTED[name]
    command = [sys.executable, "-m", "pytest", *arguments, "-q", "-p", "no:cacheprovider", "--report-dir", str(tmp_path)]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                               env={**os.environ, "PYTHONPATH": str(EXAMPLES)})
    assert completed.returncode == 0, shlex.join(command) + "\n" + completed.stdout[-3000:] + completed.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    outcomes = {(r["id"], r["outcome"], r["message"]) for r in results if r["outcome"] != "pass"}
    assert all(outcome == "not supported" and "LoRA bias" in message for _, outcome, message in outcomes), outcomes
    ops = {query.split(":")[1] for query in check("pytest", arguments).cases}
    assert ops <= {r["op"] for r in results if r["outcome"] == "pass"}, ops


# -- without the feature, the example does not pass ------------------------------------------------------


@pytest.fixture(scope="module")
def smoke() -> list[tuple[str, Case]]:
    return [(entry.case_id, Case.from_json(entry.case_json)) for entry in load_caselist("smoke").entries
            if entry.case_id.startswith("op:")]


def documented_case(smoke, name: str, op: str, where=lambda case: True) -> tuple[str, Case]:
    """The cheapest case of ``op`` the example's documented command selects, meeting ``where``."""
    queries = [parse_query(query) for query in check("pytest", DOCUMENTED[name][1]).cases]
    chosen = [(case_id, case) for case_id, case in smoke
              if case.op == op and matching(queries, case_id) and where(case) and any(s != -1 for s in case.token_slots)]
    assert chosen, (name, op)
    return min(chosen, key=lambda pair: pair[1].cost)


def served(case: Case) -> bool:
    return not case.bias


def without_feature() -> dict[str, tuple[type, type, str, Outcome]]:
    """Per example: the example's class, the same class without the feature, the op it breaks, and the outcome then."""
    broken = {
        "port_functional.py": (
            port_functional.FunctionalPort,
            # the functional op called as if it wrote its output: its result is dropped
            type("NoCopy", (port_functional.FunctionalPort,), {"bgmv_shrink": port_functional.FunctionalPort.bgmv_shrink.functional}),
            "bgmv_shrink", Outcome.FAIL),
        "port_call_context.py": (
            port_call_context.CallContextPort,
            type("NoContext", (port_call_context.CallContextPort,), {"call_context": lambda self, op: contextlib.nullcontext()}),
            "bgmv_shrink", Outcome.BROKEN),
        "port_kernel_adapter.py": (
            port_kernel_adapter.AdaptedPort,
            type("ResultDropped", (port_kernel_adapter.AdaptedPort,), {"bgmv_expand_slice": adapt(
                port_kernel_adapter.expand_slice, port_kernel_adapter.AdaptedPort.bgmv_expand_slice.arguments)}),
            "bgmv_expand_slice", Outcome.FAIL),
    }
    if MISSING_VLLM is None:
        broken |= {
            "port_returned_result.py": (
                port_returned_result.ReturnedResultPort,
                type("ReturnDropped", (port_returned_result.ReturnedResultPort,), {"can_update_inplace": True}),
                "add_lora_linear", Outcome.FAIL),
            "port_wrapper_sizing.py": (
                port_wrapper_sizing.PersistentWrapperPort,
                type("DefaultConstruction", (port_wrapper_sizing.PersistentWrapperPort,),
                     {"construct_wrapper": VllmPunicaWrapperTarget.construct_wrapper}),
                "add_lora_linear", Outcome.BROKEN),
            "port_token_slots.py": (
                port_token_slots.TokenSlotsPort,
                type("DefaultSlots", (port_token_slots.TokenSlotsPort,), {"token_lora_slots": VllmPunicaWrapperTarget.token_lora_slots}),
                "token_classification_head", Outcome.BROKEN),
        }
    return broken


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_the_example_does_not_pass_without_the_feature_it_shows(smoke, name):
    if name not in without_feature():
        pytest.skip(f"the wrapper examples need vLLM: {MISSING_VLLM}")
    example, lacking, op, outcome = without_feature()[name]
    case_id, case = documented_case(smoke, name, op, served)
    for cls in (example, lacking):
        if issubclass(cls, VllmPunicaWrapperTarget):
            cls.check_available()
    with_it = run_case(example(), case, case_id)
    assert with_it.outcome is Outcome.PASS, (case_id, with_it.message)
    without_it = run_case(lacking(), case, case_id)
    assert without_it.outcome is outcome, (case_id, without_it.outcome, without_it.message)
