"""The wire: everything that crosses between the referee and a process that runs target code, as data.

The op worker, the tensor-parallel ranks and the end-to-end runner load the target; whatever they send
back may have been written by the target or by a library it imports, so it is read as data and only
as data: frames of JSON and raw tensor bytes (:mod:`conformance.wire.frame`), turned into typed records
checked against their declared types (:mod:`conformance.wire.typed`). Nothing on this path unpickles,
loads, evaluates or imports what it reads; a malformed, oversized or mistyped message is a
:class:`WireError` naming what was wrong, which the supervisor turns into a *broken* result.
"""

from .frame import DTYPES, Channel, Limits, Message, WireError
from .typed import from_data, record_from_json, record_to_json, to_data

__all__ = ["DTYPES", "Channel", "Limits", "Message", "WireError", "from_data", "record_from_json", "record_to_json", "to_data"]
