"""The vendor's statement: who submits the bundle, for which hardware and software, signed.

certify writes a template with what the bundle certifies already filled in (target, case list and its
digest) and the vendor's fields empty; the vendor fills them in and puts the statement into the bundle
(``lora-conformance certify --restate BUNDLE --statement FILE``, which indexes the bundle again).
``verify`` reads it as TOML (data only) and reports whether every field is filled; a statement about
another target or list than the bundle's, or one that does not parse, makes the bundle invalid.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib

import json

VENDOR_FIELDS = {
    "company": "the company that submits the bundle",
    "contact": "a person and e-mail address to ask about it",
    "hardware": "the device, its generation and count (e.g. 8x Gaudi3, firmware 1.21.0)",
    "software_stack": "the software that ran the target: driver, runtime, vLLM fork or plug-in with versions",
    "date": "the date of the statement, YYYY-MM-DD",
    "signature": "the name of the person who signs for the company that the results are what the run produced",
}
CERTIFIES = ("target", "caselist", "caselist_digest")


def template(target: str, caselist: str, digest: str) -> bytes:
    """The unfilled statement of a bundle of ``target`` over ``caselist`` (``digest``)."""
    lines = [
        "# Conformance statement. Fill in every field below, then put this file into the bundle:",
        "#   lora-conformance certify --restate BUNDLE --statement statement.toml",
        "# (docs/certification.md). Leave the three fields that name what the bundle certifies as they are.",
        "",
        f"target = {json.dumps(target)}",
        f"caselist = {json.dumps(caselist)}",
        f"caselist_digest = {json.dumps(digest)}",
        "",
    ]
    for name, meaning in VENDOR_FIELDS.items():
        lines += [f"# {meaning}", f'{name} = ""']
    return ("\n".join(lines) + "\n").encode()


def statement_findings(data: bytes, target: str, caselist: str, digest: str) -> tuple[list[str], list[str]]:
    """``(problems, unfilled)``: what makes the statement unusable (it does not parse, names another target
    or list), and the vendor fields left empty."""
    try:
        statement = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return [f"not a TOML statement ({exc}); start again from the template certify writes"], list(VENDOR_FIELDS)
    problems = []
    for name, expected in zip(CERTIFIES, (target, caselist, digest)):
        if statement.get(name) != expected:
            problems.append(f"{name} = {statement.get(name)!r}, but the bundle is of {expected!r}: a statement about another bundle")
    unknown = sorted(set(statement) - set(CERTIFIES) - set(VENDOR_FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {unknown}; a statement has {list(CERTIFIES) + list(VENDOR_FIELDS)}")
    unfilled = [name for name in VENDOR_FIELDS if not (isinstance(statement.get(name), str) and statement[name].strip())]
    return problems, unfilled
