"""The operator conformance test: one test per case. It knows no target; the plugin supplies both."""

from conformance.plugin import report_outcome


def test_op(conformance_case, conformance_run):
    report_outcome(conformance_run.run(conformance_case))
