"""The conformance test: one test per case, of every level (``conformance.levels``: op, layer, model).

It knows no target and no level; the plugin supplies the case and the run, the run's level for the case
runs and judges it, and the plugin turns the result into pytest's outcome. Markers select levels:
``-m kernel``, ``-m wrapper``, ``-m tp``, ``-m e2e``.
"""

from conformance.plugin import report_outcome


def test_case(conformance_case, conformance_run):
    report_outcome(conformance_run.run(conformance_case))
