"""The report layer: a self-contained HTML conformance report, and merging the results of many shards.

``python -m conformance.report html RESULTS.json --out report.html`` renders one results document;
``python -m conformance.report merge RESULTS.json ... --out DIR`` merges shards and re-applies the gate.
"""

from conformance.report.html import write_html_report
from conformance.report.merge import MergeError, merge_documents

__all__ = ["MergeError", "merge_documents", "write_html_report"]
