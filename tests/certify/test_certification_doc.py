"""docs/certification.md shows commands the suite accepts, and says what the code does.

Each ``lora-conformance certify|verify`` command in its code blocks is parsed with the command's own parser
(certify's pytest options must not narrow the list); the members its table lists are the members a bundle
holds; the checks it numbers are the checks ``verify`` documents.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conformance.certify import bundle, verify
from conformance.certify.commands import certify_parser, narrowing_options, verify_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "certification.md"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def commands(subcommand: str) -> list[list[str]]:
    lines = [line for block in FENCE.findall(DOC.read_text()) for line in block.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith(f"lora-conformance {subcommand} ")]


def test_the_certify_commands_parse_and_run_the_whole_list():
    found = commands("certify")
    assert len(found) >= 3
    for words in found:
        args, pytest_args = certify_parser().parse_known_args(words)
        assert args.target or args.sources or args.restate, words
        assert not narrowing_options(pytest_args), words


def test_the_verify_commands_parse():
    found = commands("verify")
    assert found
    for words in found:
        verify_parser().parse_args(words)


def test_the_bundle_table_lists_every_member():
    text = DOC.read_text()
    for member in (bundle.BUNDLE, bundle.RESULTS, bundle.DIGESTS, bundle.WAIVERS, bundle.STATEMENT, bundle.CERTIFICATE,
                   "index.json", f"{bundle.MANIFESTS}input-N.json"):
        assert f"| `{member}` |" in text, member


def test_the_doc_numbers_the_checks_verify_documents():
    documented = re.findall(r"^(\d+)\. ", verify.__doc__, re.MULTILINE)
    checks = DOC.read_text().split("### The checks", 1)[1].split("\n#", 1)[0]
    in_doc = re.findall(r"^\| (\d+) \| ", checks, re.MULTILINE)
    assert in_doc == documented == [str(n) for n in range(1, 14)]
