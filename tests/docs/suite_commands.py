"""The suite's commands in a shell script, each parsed with the suite's own command line.

CI files and docs hold shell text; a misspelt option in them fails only on the vendor's machine, hours
into a job. ``suite_commands`` finds every command in a script that invokes the suite (``pytest …
conformance …``, ``python -m conformance…``, ``lora-conformance …``), and ``check`` parses one for
real:

* a pytest run with the options ``conformance.plugin`` registers (read from ``pytest_addoption``
  itself, keywords and all, so a wrong choice or a non-number is refused too), plus the standard
  pytest, pytest-xdist and allure-pytest options listed below;
* ``python -m conformance.report …`` (and ``lora-conformance report …``) with its argparse parser.

A command that invokes the suite some other way has no parser here and is refused, so that a new kind
of command in a CI file gets checked rather than waved through.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import PurePosixPath

from conformance.options_doc import plugin_options
from conformance.report.__main__ import build_parser as report_parser

# Options the examples and docs may pass that pytest or its plugins own: names → whether a value follows.
# Kept short on purpose; tests/docs/test_ci_examples.py checks that pytest knows each of them.
STANDARD_PYTEST_OPTIONS = {
    ("-n", "--numprocesses"): True,  # pytest-xdist
    ("--dist",): True,
    ("--maxprocesses",): True,
    ("--max-worker-restart",): True,
    ("-k",): True,
    ("-m",): True,
    ("-p",): True,
    ("-r",): True,
    ("--tb",): True,
    ("--maxfail",): True,
    ("--junitxml", "--junit-xml"): True,
    ("--alluredir",): True,  # allure-pytest
    ("--pyargs",): False,
    ("-q", "--quiet"): False,
    ("-v", "--verbose"): False,
    ("-x", "--exitfirst"): False,
    ("-s",): False,
    ("--clean-alluredir",): False,
}

_SEPARATORS = {";", "&&", "||", "|", "&"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"python[0-9.]*")


class CommandRefused(ValueError):
    """The suite's command line would refuse this command; the message says why, as argparse does."""


class _Refusing(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and exit; a test wants the reason
        raise CommandRefused(message)


def pytest_parser() -> argparse.ArgumentParser:
    """pytest's command line as far as a conformance run uses it. Like pytest's, it takes no abbreviations."""
    parser = _Refusing(prog="pytest", allow_abbrev=False, add_help=False)
    parser.add_argument("paths", nargs="*")
    for names, takes_value in STANDARD_PYTEST_OPTIONS.items():
        parser.add_argument(*names, action="store" if takes_value else "store_true")
    for option in plugin_options():
        parser.add_argument(*option.names, **option.settings)
    return parser


def simple_commands(script: str) -> list[list[str]]:
    """Every simple command of a shell script, as its words: lines and ``;``, ``&&``, ``||``, ``|`` split them."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in _SEPARATORS:
                commands.append(words)
                words = []
            else:
                words.append(word)
        commands.append(words)
    return [words for words in commands if words]


def invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """``(program, arguments)`` when the command runs pytest or the suite: ``pytest``, ``lora-conformance``,
    or a module of ``conformance``; None for anything else."""
    while words and _ASSIGNMENT.match(words[0]):  # VAR=value before the program
        words = words[1:]
    if not words:
        return None
    program = PurePosixPath(words[0]).name
    if program in ("pytest", "lora-conformance"):
        return program, words[1:]
    if _PYTHON.fullmatch(program) and len(words) > 2 and words[1] == "-m":
        module = words[2]
        if module == "pytest" or module == "conformance" or module.startswith("conformance."):
            return module, words[3:]
    return None


def _names_the_suite(arguments: list[str]) -> bool:
    return any(PurePosixPath(word.split("::")[0]).parts[:1] == ("conformance",) for word in arguments)


def suite_commands(script: str) -> list[tuple[str, list[str]]]:
    """The commands of ``script`` that invoke the suite, as ``invocation`` gives them."""
    found = []
    for words in simple_commands(script):
        called = invocation(words)
        if called is None or (called[0] == "pytest" and not _names_the_suite(called[1])):
            continue  # another program, or a pytest run of something else (the project's own tests)
        found.append(called)
    return found


def _parse_report(arguments: list[str]) -> argparse.Namespace:
    """``python -m conformance.report`` parses for real; its subcommands' parsers print and exit."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            return report_parser().parse_args(arguments)
        except SystemExit:
            raise CommandRefused(stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else "--help") from None


def _parse_pytest(arguments: list[str]) -> argparse.Namespace:
    namespace = pytest_parser().parse_intermixed_args(arguments)
    if not _names_the_suite(namespace.paths):
        raise CommandRefused(f"not a conformance run: no `conformance` among {namespace.paths}")
    return namespace


def check(program: str, arguments: list[str]) -> argparse.Namespace:
    """Parse one command the way the suite's command line would; CommandRefused when it would refuse it."""
    if program == "pytest":
        return _parse_pytest(arguments)
    if program in ("lora-conformance", "conformance.cli"):
        subcommand, rest = (arguments[0], arguments[1:]) if arguments else ("", [])
        if subcommand == "run":
            return _parse_pytest(["--pyargs", "conformance", *rest])  # what conformance.cli runs
        if subcommand == "report":
            return _parse_report(rest)
        raise CommandRefused(f"`{program} {subcommand}`: no parser to check it with here (tests/docs/suite_commands.py)")
    if program == "conformance.report":
        return _parse_report(arguments)
    raise CommandRefused(f"`python -m {program}`: no parser to check it with here (tests/docs/suite_commands.py)")
