"""Case ids and case queries: one grammar to name a case, select cases, waive them and replay them.

A case id is the case's level, its name within the level, and its parameters, in WebGPU CTS's query
form::

    id     = level ":" name ":" param *(";" param)
    param  = key "=" value

    op:bgmv_shrink:dtype=bf16;slices=1;rank=32;family=random
    op:fused_moe_lora:dtype=fp16;slices=1;rank=4;experts=6;top_k=2;family=random;draw=2
    layer:qkv:tp=4;dtype=fp32;fully_sharded=1;kv_replicas=2;family=neg1_last_slot
    model:greedy_generation:batch=mixed;dtype=bf16

Levels and names are lower-case words (``[a-z0-9_]``); a key likewise; a value is any run of
``[A-Za-z0-9_.+-]`` (no ``:``, ``;``, ``=``, ``*`` and no blank, so that an id needs no quoting beyond the
``;`` a shell sees). The parameters keep the order their level gives them (readability; two ids with
the same parameters in another order are different ids, which no level makes).

A query selects cases with the same grammar (``--cases``, the ``cases`` field of an expectations
entry): every part may hold ``*`` globs, and a last parameter ``*`` lets a case have parameters the
query does not list::

    op:*                                 every op case
    op:lora_*:dtype=bf16;*               every bf16 case of an op whose name starts with lora_
    layer:qkv:tp=4;*                     every 4-rank QKV case
    op:bgmv_shrink:dtype=bf16;slices=1;rank=32;family=random      exactly that case

Without the trailing ``*`` a query names its cases' complete parameter lists (values may still be
globs), so a whole id is a query that selects that one case and none of its later draws.

A bare level (``op``, ``layer``, ``model``, or a third-party level's name) is the query ``level:*``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9_]+\Z")
_VALUE = re.compile(r"[A-Za-z0-9_.+-]+\Z")
_WORD_GLOB = re.compile(r"[a-z0-9_*?]+\Z")
_VALUE_GLOB = re.compile(r"[A-Za-z0-9_.+*?-]+\Z")

GRAMMAR_HINT = "a case id is level:name:key=value;key=value… (for example op:bgmv_shrink:dtype=bf16;slices=1;rank=32;family=random)"


class QueryError(ValueError):
    """A case id or query that does not follow the grammar; the message names the part and the fix."""


def case_id(level: str, name: str, params: Mapping[str, object]) -> str:
    """The id of a case: ``level:name:k=v;…`` with the parameters in the order given. Booleans are 1/0;
    ``None`` parameters are left out (a level lists a parameter only where it says something)."""
    for what, word in (("level", level), ("name", name)):
        if not _WORD.match(word):
            raise QueryError(f"case id {what} {word!r} must be lower-case letters, digits and _ ({GRAMMAR_HINT})")
    parts = []
    for key, value in params.items():
        if value is None:
            continue
        text = str(int(value)) if isinstance(value, bool) else str(value)
        if not _WORD.match(key) or not _VALUE.match(text):
            raise QueryError(f"case id parameter {key}={text!r} of {level}:{name} is not key=value with a key of [a-z0-9_] and a "
                             f"value of [A-Za-z0-9_.+-] ({GRAMMAR_HINT})")
        parts.append(f"{key}={text}")
    if not parts:
        raise QueryError(f"case id {level}:{name} has no parameter: a case id names at least one ({GRAMMAR_HINT})")
    return f"{level}:{name}:{';'.join(parts)}"


@dataclass(frozen=True)
class CaseName:
    """A case id, parsed: what selection and expectations read instead of splitting strings."""

    level: str
    name: str
    params: tuple[tuple[str, str], ...]

    def param(self, key: str, default: str | None = None) -> str | None:
        return dict(self.params).get(key, default)

    def __str__(self) -> str:
        return f"{self.level}:{self.name}:{';'.join(f'{k}={v}' for k, v in self.params)}"


def parse_id(text: str) -> CaseName:
    """A case id's parts; a text that is not an id raises ``QueryError`` saying what is wrong."""
    level, name, params = _split(text, "case id")
    for what, word in (("level", level), ("name", name)):
        if not _WORD.match(word):
            raise QueryError(f"case id {text!r}: the {what} {word!r} must be lower-case letters, digits and _ ({GRAMMAR_HINT})")
    pairs = _pairs(text, params, "case id", _VALUE)
    if not pairs:
        raise QueryError(f"case id {text!r} has no parameters ({GRAMMAR_HINT})")
    return CaseName(level, name, pairs)


@dataclass(frozen=True)
class Query:
    """A parsed query: globs for the level and the name, (key, value glob) pairs, and whether a case may
    have parameters the query does not list."""

    text: str
    level: str
    name: str
    params: tuple[tuple[str, str], ...]
    open_ended: bool

    def matches(self, case: str | CaseName) -> bool:
        parsed = parse_id(case) if isinstance(case, str) else case
        if not fnmatch.fnmatchcase(parsed.level, self.level) or not fnmatch.fnmatchcase(parsed.name, self.name):
            return False
        have = dict(parsed.params)
        if not self.open_ended and set(have) != {key for key, _ in self.params}:
            return False
        return all(key in have and fnmatch.fnmatchcase(have[key], pattern) for key, pattern in self.params)

    def __str__(self) -> str:
        return self.text


def parse_query(text: str) -> Query:
    """A query (see the module's doc); a bare level or ``level:name`` means every case of it."""
    text = text.strip()
    if not text:
        raise QueryError(f"an empty case query selects nothing: give a level (op, layer, model), a level:name, or an id ({GRAMMAR_HINT})")
    pieces = text.split(":")
    if len(pieces) == 1:
        pieces += ["*", "*"]
    elif len(pieces) == 2:
        pieces += ["*"]
    level, name, params = _split(":".join(pieces), "case query")
    for what, word in (("level", level), ("name", name)):
        if not _WORD_GLOB.match(word):
            raise QueryError(f"case query {text!r}: the {what} {word!r} may hold lower-case letters, digits, _ and the globs * ? "
                             f"({GRAMMAR_HINT})")
    chunks = params.split(";")
    open_ended = chunks[-1] == "*"
    listed = ";".join(chunks[:-1] if open_ended else chunks)
    pairs = _pairs(text, listed, "case query", _VALUE_GLOB) if listed else ()
    return Query(text, level, name, pairs, open_ended)


def matching(queries: Iterable[Query], case: str) -> bool:
    """Whether any of ``queries`` selects ``case``."""
    parsed = parse_id(case)
    return any(query.matches(parsed) for query in queries)


def file_name(case: str) -> str:
    """A file name for a case id that every file system and shell takes unquoted: ``:`` → ``_``,
    ``;`` → ``,`` (``op_bgmv_shrink_dtype=bf16,slices=1,…``)."""
    return case.replace(":", "_").replace(";", ",")


def _split(text: str, what: str) -> tuple[str, str, str]:
    pieces = text.split(":")
    if len(pieces) != 3:
        raise QueryError(f"{what} {text!r} has {len(pieces)} part(s) separated by ':' where it needs 3 ({GRAMMAR_HINT})")
    return pieces[0], pieces[1], pieces[2]


def _pairs(text: str, params: str, what: str, value_pattern: re.Pattern) -> tuple[tuple[str, str], ...]:
    pairs = []
    for chunk in params.split(";") if params else ():
        key, equals, value = chunk.partition("=")
        if not equals or not _WORD.match(key) or not value_pattern.match(value):
            raise QueryError(f"{what} {text!r}: the parameter {chunk!r} is not key=value (key of [a-z0-9_], value of "
                             f"[A-Za-z0-9_.+-]{', globs * ? allowed' if value_pattern is _VALUE_GLOB else ''}) ({GRAMMAR_HINT})")
        if key in dict(pairs):
            raise QueryError(f"{what} {text!r} gives the parameter {key!r} twice: keep one")
        pairs.append((key, value))
    return tuple(pairs)
