"""``lora-conformance self-check [--target NAME]``: can this environment run the suite, and the target?

The check a vendor runs after installing the suite into an environment of its own (its Python, its
torch build, its device runtime; ``docs/install.md``), before a conformance run. It prints one line per
check, ``ok``, ``FAIL`` (with the fix) or ``note`` (an optional part that is missing, and what needs it):

1. **the environment**: Python, torch (version, build), every package the suite's distribution requires
   (read from its installed metadata, so the list is pyproject's, not a copy), and the pytest plugin's
   entry point (without it ``pytest conformance`` finds no option ``--target``);
2. **optional parts**, by what needs them: each extra of the distribution (``vllm``, ``e2e``, …) with
   its packages, and the tools the reports use (Node's Allure generator, chromium);
3. **the referee on this torch**: the golden ``reference`` target judged on the cheapest smoke case of
   every op, through the same worker process and referee as a run. Every case must pass: the oracle is
   float64 and the reference's own float32 path is judged by it, so a failure here means this torch
   build computes differently from the ones the suite was measured on (report it with the output);
4. with ``--target``: the target loads in a worker (its facts: device type, dtypes, ops), and its
   cheapest smoke case of every op it implements runs and is judged. Their outcomes are printed, not
   gated: a wrong number is the conformance run's verdict to give (``pytest conformance
   --target=NAME --profile=smoke``); what fails the self-check is a target that cannot load, or a case
   that did not return (broken), which is usually the installation (a device runtime, a missing module).

The exit status is 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import platform
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "lora-conformance"
PYTEST_ENTRY_POINT = ("pytest11", "lora_conformance")
OK, FAIL, NOTE = "ok", "FAIL", "note"
# What each extra is for, said next to a missing one (the extras themselves are read from the metadata).
EXTRA_PURPOSE = {
    "vllm": "the cpu target (vLLM's own CPU LoRA path) and the vLLM engine's end-to-end cases",
    "e2e": "the end-to-end cases of every profile (without tokenizers they are not supported: conformance/optional.py)",
    "reports": "allure-pytest's --alluredir (the run writes allure-results/ without it)",
    "dev": "the project's own tests (pytest-xdist, pillow, ruff, …)",
}


@dataclass(frozen=True)
class Check:
    status: str  # OK, FAIL or NOTE
    what: str
    detail: str

    def line(self) -> str:
        return f"{self.status:4}  {self.what}: {self.detail}"


def requirement_name(requirement: str) -> tuple[str, str | None]:
    """``("numpy", None)`` for ``numpy>=1``; ``("peft", "e2e")`` for ``peft; extra == "e2e"``."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", requirement)
    return name, extra.group(1) if extra else None


def applies_here(requirement: str) -> bool:
    """Whether the requirement's environment marker (less its extra) holds on this machine."""
    from packaging.requirements import Requirement

    marker = Requirement(requirement).marker
    return marker is None or marker.evaluate({"extra": requirement_name(requirement)[1] or ""})


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_checks() -> list[Check]:
    """Python, torch, the required packages and the pytest plugin; then the extras, as notes."""
    from packaging.specifiers import SpecifierSet

    needed = metadata.metadata(DISTRIBUTION).get("Requires-Python") or ""
    if platform.python_version() in SpecifierSet(needed):
        checks = [Check(OK, "python", f"{platform.python_version()} ({sys.executable})")]
    else:
        checks = [Check(FAIL, "python", f"{platform.python_version()}: the suite needs Python {needed}")]
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return [*checks, Check(FAIL, "torch", f"does not import ({type(exc).__name__}: {exc}); install your torch build first")]
    build = "cuda " + torch.version.cuda if torch.version.cuda else ("hip " + torch.version.hip if getattr(torch.version, "hip", None) else "no CUDA/ROCm")
    checks.append(Check(OK, "torch", f"{torch.__version__} ({build}); the suite leaves torch unpinned"))
    requirements = metadata.requires(DISTRIBUTION) or []
    extras: dict[str, list[str]] = {}
    for requirement in requirements:
        name, extra = requirement_name(requirement)
        if extra is not None:
            if applies_here(requirement):
                extras.setdefault(extra, []).append(name)
            continue
        if name == "torch" or not applies_here(requirement):  # tomli: only below Python 3.11
            continue
        version = installed_version(name)
        checks.append(Check(OK, name, version) if version else
                      Check(FAIL, name, f"required by the suite and not installed: pip install '{requirement}'"))
    entry_points = metadata.entry_points(group=PYTEST_ENTRY_POINT[0])
    if any(ep.name == PYTEST_ENTRY_POINT[1] for ep in entry_points):
        checks.append(Check(OK, "pytest plugin", "registered (pytest conformance --target=NAME works from any directory)"))
    else:
        checks.append(Check(FAIL, "pytest plugin", f"the {PYTEST_ENTRY_POINT[0]} entry point {PYTEST_ENTRY_POINT[1]!r} is "
                            f"not registered: install the suite as a distribution (pip install --no-deps -e PATH), "
                            "not by putting it on PYTHONPATH"))
    for extra, names in sorted(extras.items()):
        missing = [name for name in names if installed_version(name) is None]
        purpose = EXTRA_PURPOSE.get(extra, "")
        if missing:
            checks.append(Check(NOTE, f"extra [{extra}]", f"{', '.join(missing)} not installed; needed for {purpose}"))
        else:
            checks.append(Check(OK, f"extra [{extra}]", ", ".join(f"{name} {installed_version(name)}" for name in names)))
    return [*checks, *tool_checks()]


def tool_checks() -> list[Check]:
    """The report tools: Node's Allure generator and chromium (notes: results.json and report.html need neither)."""
    from conformance.report.allure_html import AllureToolMissing, check_tools, default_tools_dir

    checks = []
    try:
        checks.append(Check(OK, "allure", f"{check_tools(default_tools_dir())} (python -m conformance.report allure DIR)"))
    except AllureToolMissing as exc:
        checks.append(Check(NOTE, "allure", f"only the Allure HTML report needs it: {exc}"))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    checks.append(Check(OK, "chromium", chromium) if chromium else
                  Check(NOTE, "chromium", "not found; only the suite's own tests render the reports headless"))
    return checks


def cheapest_per_op(entries, methods: tuple[str, ...], dtypes: tuple[str, ...]) -> list:
    """Of the op cases among ``entries``, the cheapest of every op in ``methods`` in a claimed dtype."""
    from conformance.levels import OP, kind_of

    cheapest: dict[str, tuple] = {}
    for entry in entries:
        case = entry[1]
        if kind_of(case) is not OP or case.op not in methods or case.dtype not in dtypes:
            continue
        if case.op not in cheapest or case.cost < cheapest[case.op][1].cost:
            cheapest[case.op] = entry
    return [cheapest[op] for op in sorted(cheapest)]


def judged_cases(target: str, report_dir: Path) -> tuple[list[Check], list, str]:
    """The cheapest smoke case of every op ``target`` implements, run and judged as a run does them, and the name
    the checks call it: a loaded target's short name (its ``module:Class`` in the load line's detail), else
    ``target`` as given."""
    from conformance.errors import RunError
    from conformance.session import ConformanceRun, RunSettings

    try:
        run = ConformanceRun(RunSettings(target=target, profile="smoke", report_dir=str(report_dir)))
    except RunError as exc:
        return [Check(FAIL, f"target {target}", f"cannot run here: {exc}")], [], target
    facts = run.facts
    load = Check(OK, f"target {facts.name}", f"loads ({facts.reference}; device {facts.device_type}; dtypes {', '.join(facts.dtypes)})")
    try:
        results = [run.run(entry) for entry in cheapest_per_op(run.entries(), facts.methods, facts.dtypes)]
    finally:
        run.close()
    return [load], results, facts.name


def case_checks(target: str, results: list, *, gate: bool) -> list[Check]:
    """One line per op. Broken cases always fail the check; other failures only with ``gate`` (the reference)."""
    from conformance.verdict import Outcome

    checks = []
    for result in results:
        outcome = result.outcome
        detail = outcome.value + (f": {result.message.splitlines()[0][:200]}" if result.message and outcome is not Outcome.PASS else "")
        failed = outcome is Outcome.BROKEN or (gate and outcome is not Outcome.PASS)
        checks.append(Check(FAIL if failed else OK if outcome is Outcome.PASS else NOTE, f"{target} {result.case.op}", detail))
    if not results:
        checks.append(Check(FAIL, f"target {target}", "implements no op in a dtype it claims: no case could run"))
    return checks


def self_check(target: str | None, out=sys.stdout) -> int:
    from conformance.session import default_report_dir

    checks = environment_checks()
    for check in checks:
        print(check.line(), file=out)
    if any(check.status == FAIL for check in checks):
        print("\nself-check FAILED: fix the environment first (the lines marked FAIL say how)", file=out)
        return 1
    with tempfile.TemporaryDirectory(prefix="lora-conformance-self-check-") as scratch:
        # the reference first, gated; then the target (the reference once, were it named as the target too)
        for name, gate in (("reference", True), *(((target, False),) if target and target != "reference" else ())):
            loaded, results, shown = judged_cases(name, Path(scratch) / default_report_dir(name).name)
            # a target that did not load ran no case: its one FAIL says why (no device, say), not "implements no op"
            ran = case_checks(shown, results, gate=gate) if all(check.status != FAIL for check in loaded) else []
            for check in [*loaded, *ran]:
                print(check.line(), file=out)
                checks.append(check)
            if name == "reference" and any(c.status == FAIL for c in checks):
                print("\nthe golden reference did not pass its own cases on this torch: report this output", file=out)
    failed = [check for check in checks if check.status == FAIL]
    if failed:
        print(f"\nself-check FAILED: {len(failed)} check(s) marked FAIL", file=out)
        return 1
    advice = f"; the verdict: pytest conformance --target={target} --profile=smoke" if target else ""
    print(f"\nself-check passed{advice}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lora-conformance self-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="also load this target and judge its cheapest smoke case of every op")
    args = parser.parse_args(argv)
    return self_check(args.target)


if __name__ == "__main__":
    sys.exit(main())
