"""The end-to-end generation test: one test per case of ``conformance.e2e.cases`` (marker ``e2e``).

It knows no target; the plugin supplies the case, runs it on the target and applies the gate.
"""

from conformance.plugin import report_outcome


def test_e2e(e2e_case, conformance_run):
    report_outcome(conformance_run.run_e2e(e2e_case))
