"""The tensor-parallel layer test: one test per case of ``conformance.tp.cases`` (marker ``tp``, level ``layer``).

It knows no target; the plugin supplies the case, the session runs it on a pool of rank processes
(``conformance.tp``) and applies the gate.
"""

from conformance.plugin import report_outcome


def test_tp(tp_case, conformance_run):
    report_outcome(conformance_run.run_tp(tp_case))
