"""``lora-conformance self-check``: the one command of docs/install.md for an environment of one's own.

* every requirement of the installed distribution is listed, read from its metadata (not a copy), and a
  missing one fails the check with the pip command that installs it;
* the golden reference is judged on the cheapest smoke case of every op, in a worker: all pass here;
* a target that raises in the op it implements fails the check (a broken case is the installation's
  business), a target that computes a wrong number does not (that is the conformance run's verdict),
  and a target that cannot be loaded fails it with the reason;
* the console script's ``self-check`` runs the same.
"""

from __future__ import annotations

import importlib.metadata as metadata
import io
import subprocess
import sys

from conformance import selfcheck
from conformance.ops import OP_SPECS


def run_check(target=None) -> tuple[int, str]:
    out = io.StringIO()
    status = selfcheck.self_check(target, out=out)
    return status, out.getvalue()


def test_requirements_come_from_the_installed_metadata():
    required = {selfcheck.requirement_name(r)[0] for r in metadata.requires(selfcheck.DISTRIBUTION) if selfcheck.requirement_name(r)[1] is None}
    checked = {check.what for check in selfcheck.environment_checks()}
    assert required - {"torch", "tomli"} <= checked  # tomli: only on Python 3.10 (an environment marker)
    assert {"python", "torch", "pytest plugin"} <= checked
    assert ("tomli" in checked) is (sys.version_info < (3, 11))  # a requirement whose marker does not hold here is none


def test_a_missing_requirement_fails_with_the_install_command(monkeypatch):
    real = selfcheck.installed_version
    monkeypatch.setattr(selfcheck, "installed_version", lambda name: None if name == "safetensors" else real(name))
    status, text = run_check()
    assert status == 1
    line = next(line for line in text.splitlines() if line.startswith("FAIL") and "safetensors" in line)
    assert "pip install 'safetensors" in line
    assert "reference" not in text  # no case runs in an environment that is not complete


def test_requirement_names_and_extras_are_parsed():
    assert selfcheck.requirement_name("numpy") == ("numpy", None)
    assert selfcheck.requirement_name("tomli; python_version < '3.11'") == ("tomli", None)
    assert selfcheck.requirement_name('peft; extra == "e2e"') == ("peft", "e2e")
    assert selfcheck.applies_here("tomli; python_version < '3.11'") is (sys.version_info < (3, 11))


def test_the_reference_passes_every_op_and_a_raising_target_fails_the_check():
    status, text = run_check("misbehaving_targets:RaisesDeviceError")
    judged_reference = [line for line in text.splitlines() if line.split()[1:2] == ["reference"] and ":" in line]
    assert {line.split()[2].rstrip(":") for line in judged_reference} == set(OP_SPECS)
    assert all(line.startswith("ok") for line in judged_reference), text
    broken = [line for line in text.splitlines() if line.startswith("FAIL")]
    assert broken and all("broken" in line and "add_lora_linear" in line for line in broken), text
    assert status == 1


def test_a_wrong_number_is_printed_not_gated():
    # a scale applied twice is the run's verdict to give; the self-check passes and prints the failures
    status, text = run_check("fault_targets:ScaleAppliedTwice")
    assert "fail" in text and status == 0, text
    # a loaded target is named by its short name; its module:Class where it loads it, and in the command to run
    assert "ok    target fault-scale-twice: loads (fault_targets:ScaleAppliedTwice;" in text, text
    judged = [line.split()[1] for line in text.splitlines() if ": fail" in line]
    assert judged and set(judged) == {"fault-scale-twice"}, text
    assert text.rstrip().endswith("the verdict: pytest conformance --target=fault_targets:ScaleAppliedTwice --profile=smoke")


def test_a_target_that_cannot_load_fails_with_the_reason():
    status, text = run_check("no_such_module:Target")
    assert status == 1
    assert "FAIL  target no_such_module:Target: cannot run here" in text
    # its one FAIL is why it cannot run: a target that never loaded is not blamed for implementing no op
    assert "implements no op" not in text and text.rstrip().endswith("self-check FAILED: 1 check(s) marked FAIL"), text


def test_the_console_script_runs_it():
    done = subprocess.run([sys.executable, "-m", "conformance.cli", "self-check"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("self-check passed")


def test_a_module_class_targets_scratch_report_dir_holds_no_colon(monkeypatch):
    """The self-check runs each target into a scratch report dir named after it: ``pkg.mod:Class`` without its colon."""
    report_dirs = []
    monkeypatch.setattr(selfcheck, "environment_checks", lambda: [])
    monkeypatch.setattr(selfcheck, "judged_cases", lambda target, report_dir: (report_dirs.append(report_dir), ([], [], target))[1])
    run_check("fault_targets:ScaleAppliedTwice")
    assert [path.name for path in report_dirs] == ["reference", "fault_targets_ScaleAppliedTwice"]
