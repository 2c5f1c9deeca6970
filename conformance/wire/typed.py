"""Typed records as JSON data and back, checked against their own annotations: one codec for every record
that crosses a pipe or is written to a file (cases of every level, what a target's process hands back,
results read from a journal).

:func:`to_data` turns a record into JSON data (tensors left as they are, for a frame to carry);
:func:`from_data` builds a record of a declared type from data that nobody vouched for, following the
*declared* type, never the data: a dataclass or NamedTuple is an object with exactly its fields (the
ones with a default may be absent), ``tuple[int, ...]`` a list of integers, ``X | None`` either, a
``str`` enum one of its values, ``Literal[...]`` one of its values, ``torch.Tensor`` a tensor the frame
decoded. Anything else raises :class:`~conformance.wire.frame.WireError` naming the path to the bad value
(``runs[1]['y']: expected a tensor, got str``). Building a dataclass runs its own ``__post_init__`` (the
suite's validation), nothing else.

Records may write derived values for their readers beside their fields (``TPCase`` writes ``op`` and
``output_width``): name them in a class attribute ``DERIVED_JSON``; :func:`record_to_json` writes them and
:func:`record_from_json` checks that they agree with the fields.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

from .frame import WireError

_NONE = type(None)


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls) -> tuple[tuple[str, bool], ...]:
    """(field name, whether it is required) of a dataclass or NamedTuple."""
    if dataclasses.is_dataclass(cls):
        return tuple((f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                     for f in dataclasses.fields(cls) if f.init)
    defaults = getattr(cls, "_field_defaults", {})
    return tuple((name, name not in defaults) for name in cls._fields)


def _is_record(cls) -> bool:
    return isinstance(cls, type) and (dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields")))


def to_data(value) -> Any:
    """``value`` as JSON data: records as objects of their fields, tuples as lists, enums as their values;
    tensors stay tensors (a frame carries them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value.value if isinstance(value, enum.Enum) else value
    if _is_record(type(value)):
        return {name: to_data(getattr(value, name)) for name, _ in _fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): to_data(item) for key, item in value.items()}
    return value  # a tensor: the frame's to carry, or refuse


def _describe(value) -> str:
    if isinstance(value, (dict, list)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"


def _fail(where: str, expected: str, value) -> typing.NoReturn:
    raise WireError(f"{where or 'the value'}: expected {expected}, got {_describe(value)}")


def from_data(declared, data, where: str = "") -> Any:
    """A value of type ``declared`` from ``data`` (see the module docstring); ``WireError`` naming what is wrong."""
    origin = typing.get_origin(declared)
    if declared is Any:
        return data
    if declared in (_NONE, None):
        return None if data is None else _fail(where, "null", data)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(declared)
        if data is None and _NONE in options:
            return None
        errors = []
        for option in options:
            if option is _NONE:
                continue
            try:
                return from_data(option, data, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(errors[0] if len(errors) == 1 else f"{where or 'the value'}: none of {declared} fits ({'; '.join(errors)})")
    if origin is typing.Literal:
        choices = typing.get_args(declared)
        return data if isinstance(data, str | int) and not isinstance(data, bool) and data in choices else _fail(
            where, f"one of {choices}", data)
    if declared is bool:
        return data if isinstance(data, bool) else _fail(where, "a boolean", data)
    if declared is int:
        return data if isinstance(data, int) and not isinstance(data, bool) else _fail(where, "an integer", data)
    if declared is float:
        return float(data) if isinstance(data, int | float) and not isinstance(data, bool) else _fail(where, "a number", data)
    if declared is str:
        return data if isinstance(data, str) else _fail(where, "a string", data)
    if origin in (tuple, list):
        args = typing.get_args(declared)
        if not isinstance(data, list):
            _fail(where, "a list", data)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(data) != len(args):
                _fail(where, f"a list of {len(args)}", data)
            return tuple(from_data(arg, item, f"{where}[{i}]") for i, (arg, item) in enumerate(zip(args, data)))
        items = [from_data(args[0] if args else Any, item, f"{where}[{i}]") for i, item in enumerate(data)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_type, value_type = typing.get_args(declared) or (str, Any)
        if not isinstance(data, dict):
            _fail(where, "an object", data)
        return {from_data(key_type, key, where): from_data(value_type, item, f"{where}[{key!r}]") for key, item in data.items()}
    if isinstance(declared, type) and issubclass(declared, enum.Enum):
        try:
            return declared(data)
        except (ValueError, TypeError):
            _fail(where, f"one of {[member.value for member in declared]}", data)
    if _is_record(declared):
        return _record(declared, data, where)
    if getattr(declared, "__module__", "") == "torch" and getattr(declared, "__name__", "") == "Tensor":
        import torch

        return data if type(data) is torch.Tensor else _fail(where, "a tensor", data)
    raise TypeError(f"from_data does not know how to read {declared!r} (at {where or 'the top'})")


def _record(cls, data, where: str):
    if not isinstance(data, dict):
        _fail(where, f"an object (a {cls.__name__})", data)
    fields = _fields(cls)
    names = {name for name, _ in fields}
    derived = set(getattr(cls, "DERIVED_JSON", ()))
    unknown = sorted(set(data) - names - derived)
    missing = sorted(name for name, required in fields if required and name not in data)
    if unknown or missing:
        raise WireError(f"{where or 'the value'}: a {cls.__name__} has the fields {sorted(names)}"
                        + (f"; unknown: {[str(k)[:40] for k in unknown[:8]]}" if unknown else "")
                        + (f"; missing: {missing}" if missing else ""))
    hints = _hints(cls)
    values = {name: from_data(hints[name], data[name], f"{where}.{name}" if where else name) for name in names if name in data}
    try:
        record = cls(**values)
    except (ValueError, TypeError) as exc:  # the record's own validation (__post_init__)
        raise WireError(f"{where or 'the value'}: not a valid {cls.__name__}: {str(exc)[:500]}") from None
    for name in derived & set(data):
        if data[name] != to_data(getattr(record, name)):
            raise WireError(f"{where or 'the value'}: {name} is {str(data[name])[:80]!r}, but the other fields make it "
                            f"{to_data(getattr(record, name))!r}")
    return record


def record_to_json(record) -> dict:
    """A record's fields as JSON data, then its ``DERIVED_JSON`` values (for readers of the file it goes to)."""
    data = to_data(record)
    return {**data, **{name: to_data(getattr(record, name)) for name in getattr(type(record), "DERIVED_JSON", ())}}


def record_from_json(cls, data, what: str = ""):
    """The ``cls`` record :func:`record_to_json` wrote; ``ValueError`` (a :class:`WireError`) naming what is wrong."""
    return from_data(cls, data, what)
