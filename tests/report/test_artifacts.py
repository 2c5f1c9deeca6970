"""What one run leaves behind, checked with the real tools: JUnit XML, Allure results, report.html in
headless chromium, the Allure HTML from the pinned npm allure without network, progress lines and one
device per xdist worker.

A module-scoped run of a seeded-fault target (``fault_targets:ScaleAppliedTwice``) over two ops of
the smoke profile under ``-n 2`` gives a report with failing cases. Tools CI installs (chromium,
Node with ``npm ci --prefix report-tools``) are required: a missing one fails with the command that
installs it, it never skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from allure_commons.utils import md5
from PIL import Image
from test_report import parse

from conformance.report.allure_results import CATEGORIES, SEVERITY_BY_LEVEL, cluster_categories
from conformance.report.fingerprint import NOT_A_CHECKOUT

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]  # the test targets live in tests/
FAULTY = ("--target=fault_targets:ScaleAppliedTwice", "--profile=smoke", "-k", "bgmv_shrink or add_shrink")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--window-size=1280,900", "--virtual-time-budget=5000",
)  # fmt: skip


def conformance(*args: str, report_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--report-dir", str(report_dir), *args]
    env = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}  # the test targets live in tests/
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):  # when these tests run under xdist
        env.pop(name, None)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    report_dir = tmp_path_factory.mktemp("faulty")
    completed = conformance(*FAULTY, "-n", "2", "--progress-every=0", report_dir=report_dir)
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    document = json.loads((report_dir / "results.json").read_text())
    assert any(r["outcome"] == "fail" for r in document["results"])
    return report_dir, completed, document


def allure_results(report_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (report_dir / "allure-results").glob("*-result.json")]


def test_results_json_carries_the_fingerprint_and_each_workers_device(faulty_run):
    _, _, document = faulty_run
    environment = document["environment"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if (ROOT / ".git").exists():
        assert environment["git_commit"] == head and environment["git_tree"] in ("clean", "dirty")
    else:  # the suite exported without its history (git archive, an sdist)
        assert environment["git_commit"] == environment["git_tree"] == NOT_A_CHECKOUT
    assert environment["torch"] == torch.__version__ and environment["python"] == sys.version.split()[0]
    assert environment["suite_version"] == document["suite_version"] and environment["device"].startswith("cpu")
    for key in ("vllm", "transformers", "lora-conformance", "driver", "host"):
        assert environment[key]
    assert [w["worker"] for w in document["workers"]] == ["gw0", "gw1"]
    assert {r["worker"] for r in document["results"]} == {"gw0", "gw1"}


def test_junit_xml_is_written_by_default_with_the_fingerprint_as_suite_properties(faulty_run):
    report_dir, completed, document = faulty_run
    suite = ET.parse(report_dir / "junit.xml").getroot().find("testsuite")
    properties = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert properties == {k: str(v) for k, v in document["environment"].items()}
    cases = suite.findall("testcase")
    assert len(cases) == len(document["results"])
    failed = sum(1 for r in document["results"] if r["outcome"] == "fail")
    assert int(suite.get("failures")) == failed
    assert f"junit: {report_dir / 'junit.xml'}" in completed.stdout


def test_allure_results_have_suites_severity_parameters_and_categories(faulty_run):
    report_dir, _, document = faulty_run
    by_id = {r["id"]: r for r in document["results"]}
    results = allure_results(report_dir)
    assert len(results) == len(by_id)
    categories = json.loads((report_dir / "allure-results" / "categories.json").read_text())
    for result in results:
        params = {p["name"]: p for p in result["parameters"]}
        record = by_id[params["conformance_case"]["value"]]
        labels = {}
        for label in result["labels"]:
            labels.setdefault(label["name"], []).append(label["value"])
        assert labels["parentSuite"] == [record["level"]] and labels["suite"] == [record["op"]]
        assert labels["subSuite"] == [record["family"]] and record["dtype"] in labels["tag"]
        assert labels["severity"] == [SEVERITY_BY_LEVEL[record["level"]]]
        assert params["dtype"]["value"] == repr(record["dtype"]) and "tokens=" in params["shape"]["value"]
        assert params["case seed"]["excluded"] and params["run seed"]["excluded"]
        assert params["case seed"]["value"] == str(record["case"]["seed"])
        # the history id hashes the test and its included parameters only: no seed in it
        included = sorted((p for p in result["parameters"] if not p.get("excluded")), key=lambda p: p["name"])
        assert result["historyId"] == md5(result["fullName"], *(p["value"] for p in included))
        assert {p["name"] for p in included} == {"conformance_case", "dtype", "shape"}
        expected_status = {"pass": "passed", "fail": "failed", "not supported": "skipped"}[record["outcome"]]
        assert result["status"] == expected_status
        if expected_status != "passed":
            cluster = next((c for c in document["clusters"] if c["id"] == record.get("cluster")), None)
            expected_category = f"Problem {cluster['id']}/{len(document['clusters'])}: {cluster['title']}" if cluster else "Not supported"
            assert _category(result, categories) == expected_category, result["statusDetails"]
    assert {"kernel", "wrapper"} <= {r["level"] for r in document["results"]}
    properties = (report_dir / "allure-results" / "environment.properties").read_text()
    assert f"git_commit={document['environment']['git_commit']}" in properties.splitlines()
    assert categories == cluster_categories(document) + CATEGORIES


def _category(result: dict, categories: list[dict]) -> str:
    """The first of ``categories`` Allure would put ``result`` in (Allure: first match wins)."""
    message = (result.get("statusDetails") or {}).get("message", "")
    for category in categories:
        if result["status"] in category["matchedStatuses"] and re.fullmatch(category.get("messageRegex", "(?s).*"), message):
            return category["name"].rsplit(" (", 1)[0]  # less its "(kind; N cases in M ops)"; a title may hold parentheses
    return "none"


def test_progress_lines_count_cases_and_failures_under_xdist(faulty_run):
    _, completed, document = faulty_run
    lines = [line for line in completed.stdout.splitlines() if line.startswith("[progress]")]
    total = len(document["results"])
    failures = sum(1 for r in document["results"] if r["outcome"] == "fail")
    assert len(lines) == total + 1  # after every case (--progress-every=0), and once at the end
    assert lines[-1].startswith(f"[progress] {total}/{total} cases, {failures} failures; 2 done; elapsed ")
    counts = [int(re.match(r"\[progress\] (\d+)/", line).group(1)) for line in lines]
    assert counts == [*range(1, total + 1), total]


def test_progress_lines_in_a_serial_run_name_the_ops_in_flight(tmp_path):
    completed = conformance("--target=reference", "--profile=smoke", "-k", "bgmv_shrink", "--progress-every=0", report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("[progress]")]
    total = len(json.loads((tmp_path / "results.json").read_text())["results"])
    assert lines[0].startswith(f"[progress] 1/{total} cases, 0 failures; bgmv_shrink 1/{total}; elapsed ")
    assert "about" in lines[0] and "left" in lines[0]
    assert lines[-1].startswith(f"[progress] {total}/{total} cases, 0 failures; 1 done; elapsed ")


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium (.ci/run installs it)")
    return path


def test_report_html_renders_in_headless_chromium_with_verdict_matrix_and_repro(faulty_run, tmp_path):
    report_dir, _, document = faulty_run
    url = (report_dir / "report.html").resolve().as_uri()
    base = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "report.png"
    completed = subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0 and shot.is_file(), completed.stderr[-2000:]
    width, height, colours = png_summary(shot)
    assert (width, height) == (1280, 900)
    assert colours >= 20, "the screenshot is blank"  # text, badges and the plot give hundreds
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    page = parse_html(dom, tmp_path)
    assert page.text["#verdict"][0].strip().startswith("FAIL")
    matrix = page.text["#matrix"][0]
    assert "bgmv_shrink" in matrix and "add_shrink" in matrix and "fail" in matrix
    failing = next(r for r in document["results"] if r["outcome"] == "fail")
    assert failing["repro"] in page.text[".repro"]
    assert failing["repro"].startswith("pytest conformance --target=fault_targets:ScaleAppliedTwice --replay ")
    assert document["environment"]["git_commit"] in page.text["#environment"][0]


def parse_html(text: str, tmp_path: Path):
    path = tmp_path / "dom.html"
    path.write_text(text)
    return parse(path)


def png_summary(path: Path) -> tuple[int, int, int]:
    """Width, height and number of distinct colours of a PNG (Pillow checks that it is one)."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        colours = image.convert("RGB").getcolors(maxcolors=1 << 24)
        return image.width, image.height, len(colours)


def test_allure_single_file_html_is_generated_offline_by_the_pinned_allure(faulty_run):
    report_dir, _, _ = faulty_run
    command = [sys.executable, "-m", "conformance.report", "allure", str(report_dir)]
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-n", *command]  # no network at all: generation must not fetch anything
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, f"{completed.stderr}\n(CI installs Node and runs npm ci --prefix report-tools)"
    index = report_dir / "allure-report" / "index.html"
    assert f"allure report: {index}" in completed.stdout
    assert sorted(p.name for p in index.parent.iterdir() if p.suffix in (".html", ".js", ".css")) == ["index.html"]
    html = index.read_text()
    assert len(html) > 500_000 and "3.18.0" in html  # the app and the data inlined, from the locked version
    assert json.loads((ROOT / "report-tools" / "package-lock.json").read_text())["packages"]["node_modules/allure"]["version"] == "3.18.0"



def test_allure_single_file_html_renders_offline_in_headless_chromium(faulty_run, tmp_path):
    """The generated page is an app that renders from the inlined data (it needs ~10 s of virtual time)."""
    report_dir, _, document = faulty_run
    index = report_dir / "allure-report" / "index.html"
    if not index.is_file():
        subprocess.run([sys.executable, "-m", "conformance.report", "allure", str(report_dir)], cwd=ROOT, check=True, timeout=600)
    # The app decodes its inlined data asynchronously; on a loaded machine the first dump can come before
    # it has drawn, so the page gets up to three tries with more virtual time each.
    for budget in (30_000, 60_000, 120_000):
        flags = [f if not f.startswith("--virtual-time-budget") else f"--virtual-time-budget={budget}" for f in CHROMIUM_FLAGS]
        dom = subprocess.run(
            [chromium(), *flags, f"--user-data-dir={tmp_path / f'profile-{budget}'}", "--dump-dom", index.resolve().as_uri()],
            capture_output=True, text=True, timeout=300,
        ).stdout
        text = " ".join(re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)\b.*?</\1>", "", dom, flags=re.S)).split())
        if "Total " in text:
            break
    assert f"Total {len(document['results'])}" in text, text[:2000]
    assert "Failed" in text and "Ver: 3.18.0" in text
    assert document["environment"]["git_commit"][:12] in text  # environment.properties reached the page


def test_allure_command_names_what_to_install(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(ROOT / "report-tools" / "package-lock.json", tools)
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.report", "allure", str(tmp_path), "--tools", str(tools)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert completed.returncode == 2 and f"run: npm ci --prefix {tools}" in completed.stderr, completed.stderr
    no_node = {**os.environ, "PATH": str(tmp_path)}  # a machine without Node on its PATH
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.report", "allure", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, env=no_node
    )
    assert completed.returncode == 2 and "needs Node.js" in completed.stderr and "apt-get install -y nodejs npm" in completed.stderr


def test_each_xdist_worker_gets_its_own_device_before_the_target_loads(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    args = ("--target=device_probe_target:GaudiShapedProbe", "--profile=smoke", "-k", "bgmv_shrink", "-n", "2", "--devices=5,7")
    completed = conformance(*args, report_dir=tmp_path / "report", env={"LORA_CONFORMANCE_PROBE_DIR": str(probe), "HABANA_VISIBLE_MODULES": ""})
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    seen = {p.stem: json.loads(p.read_text())["HABANA_VISIBLE_MODULES"] for p in probe.glob("*.json")}
    # only the processes that run cases load the target (each worker's isolated process, which inherits
    # the worker's variable); the controller never loads it, so it cannot claim a device
    assert seen == {"gw0": "5", "gw1": "7"}
    document = json.loads((tmp_path / "report" / "results.json").read_text())
    assert [(w["worker"], w["HABANA_VISIBLE_MODULES"]) for w in document["workers"]] == [("gw0", "5"), ("gw1", "7")]
    workers = parse(tmp_path / "report" / "report.html").text["#workers"][0]
    assert "HABANA_VISIBLE_MODULES" in workers and "gw1" in workers


def test_devices_mistakes_are_one_usage_error(tmp_path):
    completed = conformance("--target=reference", "-n", "3", "--devices=0,1", "--device-env=CUDA_VISIBLE_DEVICES", report_dir=tmp_path)
    assert completed.returncode == 4 and "-n 3 workers but --devices lists 2" in completed.stderr
    completed = conformance("--target=reference", "--devices=0,1", report_dir=tmp_path)
    assert completed.returncode == 4 and "runs on cpu" in completed.stderr and "--device-env" in completed.stderr


def test_junit_and_allure_results_of_a_run_get_the_cluster_of_each_failure(faulty_run, tmp_path):
    """junit.xml and the Allure results, both written from the results document once the run's clusters are known."""
    from conformance.report.allure_results import cluster_categories
    from conformance.report.clusters import cluster_of

    report_dir, _, document = faulty_run
    shutil.copytree(report_dir / "allure-results", tmp_path / "allure-results")
    by_case = cluster_of(document)
    total = len(document["clusters"])
    failing = {r["id"]: r for r in document["results"] if r["outcome"] == "fail"}
    assert total >= 1 and set(by_case) == set(failing)

    for testcase in ET.parse(report_dir / "junit.xml").getroot().iter("testcase"):
        case_id = testcase.get("name").split("[", 1)[1][:-1]
        [element] = list(testcase.iter("failure")) or [None]
        if case_id in failing:
            record, cluster = failing[case_id], by_case[case_id]
            lead = f"fail [{', '.join(record['kinds'])}] cluster {cluster['id']}/{total} \"{cluster['title']}\": "
            assert lead in element.get("message") and element.text.startswith(lead)
        else:
            assert element is None

    categories = json.loads((tmp_path / "allure-results" / "categories.json").read_text())
    assert categories == cluster_categories(document) + CATEGORIES
    for result in allure_results(tmp_path):
        case_id = {p["name"]: p["value"] for p in result["parameters"]}["conformance_case"]
        if case_id in failing:  # Allure files each failure under its problem
            cluster = by_case[case_id]
            assert _first_category(result, categories).startswith(f"Problem {cluster['id']}/{total}: {cluster['title']} (")
        else:
            assert not _first_category(result, categories).startswith("Problem ")


def _first_category(result: dict, categories: list[dict]) -> str:
    message = (result.get("statusDetails") or {}).get("message", "")
    for category in categories:
        if result["status"] in category["matchedStatuses"] and re.fullmatch(category.get("messageRegex", "(?s).*"), message):
            return category["name"]
    return "none"
