"""Frozen case lists: the cases a certification run judges, the same on every machine (``caselist``).

``pytest conformance --target=NAME --caselist smoke`` runs a shipped list; ``python -m conformance.caselists``
writes and checks them (docs/certification.md).
"""

from conformance.digest import fingerprints_agree, oracle_fingerprint

from .caselist import CASELISTS_DIR, Caselist, CaselistEntry, CaselistError, load_caselist, released_caselists, write_caselist
from .freeze import freeze, rejudge_entry

__all__ = [
    "CASELISTS_DIR", "Caselist", "CaselistEntry", "CaselistError", "fingerprints_agree", "freeze", "load_caselist",
    "oracle_fingerprint", "rejudge_entry", "released_caselists", "write_caselist",
]
