"""The Allure HTML report: one self-contained file, generated offline from a run's Allure results.

``python -m conformance.report allure REPORT_DIR`` runs the npm package ``allure`` (Allure 3) that
``npm ci --prefix report-tools`` installed from the committed lock file, with
``report-tools/allurerc.mjs`` (single-file output). It runs the installed binary through
``npx --no-install``, so it never fetches anything: generation works without network. It is a step
of its own, after the pytest run, so that running the suite never depends on Node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import conformance

ALLURE_VERSION = "3.18.0"
TOOLS_ENV = "LORA_CONFORMANCE_REPORT_TOOLS"  # where a vendor keeps report-tools outside a checkout


class AllureToolMissing(RuntimeError):
    """Node, npx or the locked allure install is missing; the message names what to install."""


def default_tools_dir() -> Path:
    return Path(os.environ.get(TOOLS_ENV) or Path(conformance.__file__).resolve().parents[1] / "report-tools")


def check_tools(tools: Path) -> Path:
    """The installed allure binary under ``tools``, or :class:`AllureToolMissing` naming the fix."""
    if shutil.which("node") is None or shutil.which("npx") is None:
        raise AllureToolMissing(
            "the Allure HTML report needs Node.js (node and npx, Node 20 or newer): install it "
            "(Debian: apt-get install -y nodejs npm), then run: npm ci --prefix " + str(tools)
        )
    if not (tools / "package-lock.json").is_file():
        raise AllureToolMissing(
            f"{tools} has no package-lock.json: point --tools (or ${TOOLS_ENV}) at the suite's report-tools folder"
        )
    binary = tools / "node_modules" / ".bin" / "allure"
    if not binary.exists():
        raise AllureToolMissing(f"allure {ALLURE_VERSION} is not installed in {tools}: run: npm ci --prefix {tools}")
    return binary


def generate_allure_html(report_dir, out=None, tools=None, name: str | None = None) -> Path:
    """Generate ``<out>/index.html`` (default ``REPORT_DIR/allure-report``) from ``REPORT_DIR/allure-results``."""
    report_dir = Path(report_dir).resolve()
    results = report_dir / "allure-results"
    tools = Path(tools).resolve() if tools else default_tools_dir().resolve()
    check_tools(tools)
    if not any(results.glob("*-result.json")):
        raise FileNotFoundError(f"{results} holds no Allure results: run pytest conformance with --report-dir {report_dir} first")
    out = Path(out).resolve() if out else report_dir / "allure-report"
    if out.exists():
        shutil.rmtree(out)  # a stale multi-file report beside the new single file would confuse
    command = [
        "npx", "--no-install", "allure", "generate", str(results),
        "--config", str(tools / "allurerc.mjs"), "--output", str(out),
        "--report-name", name or f"LoRA conformance: {report_dir.name}",
    ]  # fmt: skip
    # npm reads its cache and update notifier from the environment; neither may reach the network.
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_offline": "true"}
    completed = subprocess.run(command, cwd=tools, env=env, capture_output=True, text=True, timeout=600)
    index = out / "index.html"
    if completed.returncode != 0 or not index.is_file():
        raise RuntimeError(
            f"allure generate failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}{completed.stderr[-3000:]}"
        )
    return index
