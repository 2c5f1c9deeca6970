"""lora-conformance: does a backend compute multi-LoRA (Punica) ops exactly as it must?

The public surface, for scripts and vendor tooling (``pytest conformance --target=NAME`` needs none
of it)::

    from conformance import load_target, profile_cases, run_case

    target = load_target("cpu")
    for case_id, case in profile_cases("smoke"):
        result = run_case(target, case, case_id)
        print(case_id, result.outcome.value, result.message)

    from conformance import ConformanceRun, RunSettings    # a whole run, with its report, no pytest

    document = ConformanceRun(RunSettings(target="cpu", profile="smoke")).run_all()

Names are imported on first use, so ``import conformance.reference`` stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ConformanceRun": "conformance.session",
    "RunSettings": "conformance.session",
    "FailureKind": "conformance.verdict.failure_kind",
    "Case": "conformance.cases.case",
    "case_features": "conformance.cases.features",
    "LoRAMapping": "conformance.reference.mapping",
    "PunicaWrapperReference": "conformance.reference.punica_wrapper",
    "OP_SPECS": "conformance.ops",
    "profile_cases": "conformance.generator.profiles",
    "PROFILES": "conformance.generator.profiles",
    "run_case": "conformance.runner",
    "CaseResult": "conformance.record",
    "Outcome": "conformance.verdict.outcome",
    "judge": "conformance.verdict.judge",
    "Target": "conformance.targets.base",
    "TargetUnavailable": "conformance.targets.base",
    "load_target": "conformance.targets.registry",
    "list_targets": "conformance.targets.registry",
}
_RENAMED = {"load_target": "load"}

__all__ = [  # every lazily exported name (_EXPORTS), listed for tools that read __all__ statically
    "__version__",
    "Case",
    "CaseResult",
    "ConformanceRun",
    "FailureKind",
    "LoRAMapping",
    "OP_SPECS",
    "Outcome",
    "PROFILES",
    "PunicaWrapperReference",
    "RunSettings",
    "Target",
    "TargetUnavailable",
    "case_features",
    "judge",
    "list_targets",
    "load_target",
    "profile_cases",
    "run_case",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value
