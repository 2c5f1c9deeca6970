"""``lora-conformance``: the suite's console script, one entry to the commands of its modules.

    lora-conformance run --target=NAME [pytest options…]   the conformance run (pytest --pyargs conformance …)
    lora-conformance targets [list]                         which targets can run here
    lora-conformance describe NAME                          what one target implements, op × dtype
    lora-conformance report html|merge|allure|compare …     reports, merges, comparisons (python -m conformance.report)
    lora-conformance self-check [--target=NAME]             can this environment run the suite (and the target)?
    lora-conformance certify --target=NAME --caselist NAME  run a released case list, write one bundle to submit
    lora-conformance certify --from DIR [DIR ...]           bundle runs (or shards) of a list already made
    lora-conformance verify BUNDLE [--rejudge N]            check a bundle: 0 conformant, 1 not, 2 invalid

``run`` is ``pytest --pyargs conformance`` with the given options: it works from any directory of an
environment where the suite is installed, and its exit code is the gate's. ``certify`` and ``verify``
(``conformance.certify``) are the submission and its review: docs/certification.md.
"""

from __future__ import annotations

import sys

USAGE = __doc__.split("\n\n")[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "run":
        import pytest

        return int(pytest.main(["--pyargs", "conformance", *rest]))
    if command in ("targets", "describe"):
        from conformance.targets.__main__ import main as targets_main

        if command == "describe":
            return targets_main(["describe", *rest])
        return targets_main(rest or ["list"])
    if command == "self-check":
        from conformance.selfcheck import main as self_check_main

        return self_check_main(rest)
    if command in ("certify", "verify"):
        from conformance.certify.commands import certify_main, verify_main

        return certify_main(rest) if command == "certify" else verify_main(rest)
    if command == "report":
        from conformance.report.__main__ import main as report_main

        return report_main(rest)
    stream = sys.stdout if command in ("-h", "--help") else sys.stderr
    print(f"usage:\n{USAGE}", file=stream)
    return 0 if stream is sys.stdout else 2


if __name__ == "__main__":
    sys.exit(main())
