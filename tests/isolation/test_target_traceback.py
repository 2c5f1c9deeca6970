"""A case whose target raised keeps the whole Python traceback, formatted in the target's process.

``conformance.text.format_traceback`` formats it where the frames are (the worker, a rank, the
end-to-end runner) and only its text crosses the pipe; the record's ``traceback`` holds the suite's
frames from ``conformance.target_call`` into the target's, and the chained causes, so a vendor can
debug a failure inside an interop layer from the report alone. A crash or a hang raised nothing: its
record has no traceback. The reports that show it are tested in tests/report/test_traceback_reports.py.

The targets here are loaded by name in a worker process too (it gets this process's ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace

import pytest
from misbehaving_targets import Aborts, RaisesDeviceError, UnprintableError

from conformance.generator import profile_cases
from conformance.isolation import IsolatedExecutor
from conformance.levels.op import OP
from conformance.runner import run_case
from conformance.targets.reference import ReferenceTarget
from conformance.text import TRACEBACK_LIMIT, format_traceback
from conformance.verdict import FailureKind, Outcome

UNSAFE = re.compile(r"[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what conformance.text escapes
FRAME = re.compile(r'^  File "(.+)", line \d+, in (.+)$', re.MULTILINE)


class InteropError(RuntimeError):
    """What an interop layer raises around the driver's error."""


def _driver_call() -> None:
    raise OSError("driver: invalid device handle 0xdead")


class RaisesFromACause(ReferenceTarget):
    """An interop layer between vLLM's calls and a driver: it wraps the driver's error in its own."""

    name = "raises-from-a-cause"

    def add_lora_linear(self, *args, **kwargs):
        try:
            _driver_call()
        except OSError as exc:
            raise InteropError("the interop layer could not launch add_lora_linear") from exc


class RaisesWhileLoading(ReferenceTarget):
    """Its constructor raises (no device found): every case reports it, with its traceback."""

    name = "raises-while-loading"

    def __init__(self) -> None:
        raise RuntimeError("no device found while loading the target")


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def frames(text: str) -> list[tuple[str, str]]:
    """``(file, function)`` of every frame in a formatted traceback."""
    return FRAME.findall(text)


@pytest.fixture(scope="module")
def linear_case():
    return next((case_id, case) for case_id, case in profile_cases("smoke", 0) if case.op == "add_lora_linear" and case.dtype == "float32")


# -- formatting --------------------------------------------------------------------------------------


def test_a_traceback_holds_every_frame_and_the_cause_it_was_raised_from():
    try:
        RaisesFromACause().add_lora_linear()
    except InteropError as exc:
        text = format_traceback(exc)
    assert text.startswith("Traceback (most recent call last):")
    assert "OSError: driver: invalid device handle 0xdead" in text
    assert "The above exception was the direct cause of the following exception:" in text
    assert text.endswith("InteropError: the interop layer could not launch add_lora_linear")
    functions = [function for _, function in frames(text)]
    assert functions == ["add_lora_linear", "_driver_call", "test_a_traceback_holds_every_frame_and_the_cause_it_was_raised_from",
                         "add_lora_linear"], text


def test_a_40_frame_traceback_with_a_40_frame_cause_fits_whole(tmp_path):
    """Forty distinct frames with their source lines (Python 3.11 marks the failing expression under
    each), raised from a cause as deep: nothing is cut."""
    lines = ["def level_0(values):\n    raise ValueError(f'the launch configuration is invalid for {len(values)} values')\n"]
    for depth in range(1, 40):
        lines.append(f"def level_{depth}(values):\n    return level_{depth - 1}(values) + sum(v * 2 for v in values if v is not None)\n")
    lines.append(
        "def wrapped(values):\n    try:\n        return level_39(values)\n    except ValueError as exc:\n"
        "        raise RuntimeError('the interop layer gave up') from exc\n"
    )
    lines.append("def entry(values):\n    return " + "".join(f"outer_{i}(" for i in range(39, -1, -1)) + "values" + ")" * 40 + "\n")
    lines += [f"def outer_{i}(values):\n    return {'wrapped' if i == 0 else f'outer_{i - 1}'}(values)\n" for i in range(40)]
    path = tmp_path / "interop_layer.py"
    path.write_text("\n".join(lines))
    spec = importlib.util.spec_from_file_location("interop_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.outer_39([1, 2, 3])
    except RuntimeError as exc:
        text = format_traceback(exc)
    assert "characters cut" not in text and len(text) <= TRACEBACK_LIMIT, len(text)
    functions = {function for _, function in frames(text)}
    assert {f"level_{i}" for i in range(40)} | {f"outer_{i}" for i in range(40)} <= functions
    assert text.endswith("RuntimeError: the interop layer gave up")


def test_a_hostile_exception_gives_a_safe_bounded_traceback_and_never_raises():
    text = format_traceback(raised(RuntimeError("driver said \udcff at \x00 \x1b[31mred\x1b[0m")))
    assert "RuntimeError: driver said \\udcff at \\x00 \\x1b[31mred\\x1b[0m" in text and not UNSAFE.search(text.replace("\n", ""))

    text = format_traceback(raised(UnprintableError("gone")))
    assert text.startswith("Traceback (most recent call last):") and "UnprintableError" in text

    # a 10 MB device log in the cause does not crowd out the exception raised from it, nor its frames
    try:
        try:
            raise RuntimeError("synapse log line\n" * 700_000)
        except RuntimeError as cause:
            raise InteropError("the interop layer gave up") from cause
    except InteropError as exc:
        text = format_traceback(exc)
    assert len(text) <= TRACEBACK_LIMIT and "characters cut" in text and not UNSAFE.search(text.replace("\n", ""))
    assert "The above exception was the direct cause" in text and text.endswith("InteropError: the interop layer gave up")
    assert len(frames(text)) == 2

    # exceptions that are each other's context: formatted once each, and it ends
    first, second = RuntimeError("first"), RuntimeError("second")
    first.__context__, second.__context__ = second, first
    assert "RuntimeError: first" in format_traceback(raised(first))


# -- op cases ----------------------------------------------------------------------------------------


def test_an_op_case_whose_target_raised_records_the_suite_frames_and_the_target_frames(linear_case):
    case_id, case = linear_case
    result = run_case(RaisesDeviceError(), case, case_id, runs=1, second_attempt=False)
    assert (result.outcome, result.kinds) == (Outcome.BROKEN, (FailureKind.RAISED,)), result.message
    files = [file for file, _ in frames(result.traceback)]
    assert len(files) > 1 and files[0].endswith("conformance/target_call.py"), result.traceback
    assert files[-1].endswith("tests/misbehaving_targets.py") and "in misbehave" in result.traceback
    assert result.traceback.endswith("RuntimeError: synapse error 26: simulated device failure in add_lora_linear")
    assert result.to_json()["traceback"] == result.traceback
    # what raised and where, as data (the clusters group by it): the target's frame, not the suite's
    assert result.to_json()["raised"] == {"type": "RuntimeError", "frame": "misbehaving_targets.py:RaisesDeviceError.misbehave"}

    passed = run_case(ReferenceTarget(), case, case_id, runs=1, second_attempt=False)
    assert passed.outcome is Outcome.PASS and passed.traceback is None and "traceback" not in passed.to_json()


@pytest.mark.integration
def test_the_traceback_crosses_from_the_worker_process_with_its_cause(linear_case):
    case_id, case = linear_case
    executor = IsolatedExecutor("test_target_traceback:RaisesFromACause", case_timeout=120)
    try:
        result = OP.run(SimpleNamespace(executor=executor, repeat=2, require_deterministic=False), case_id, case)
    finally:
        executor.close()
    assert (result.outcome, result.kinds) == (Outcome.BROKEN, (FailureKind.RAISED,)), result.message
    found = frames(result.traceback)
    assert ("target_call.py", "call_target") in [(file.rsplit("/", 1)[-1], function) for file, function in found], result.traceback
    # the cause's frames (the layer, then the driver call), then the layer again where it raised its own error
    assert [function for file, function in found if file.endswith("test_target_traceback.py")] == ["add_lora_linear", "_driver_call",
                                                                                                   "add_lora_linear"]
    assert "OSError: driver: invalid device handle 0xdead" in result.traceback
    assert result.traceback.endswith("InteropError: the interop layer could not launch add_lora_linear")
    # made in the worker beside the traceback, and read back across the pipe
    assert result.raised == {"type": "InteropError", "frame": "test_target_traceback.py:RaisesFromACause.add_lora_linear"}


@pytest.mark.integration
def test_a_target_that_raises_while_loading_leaves_its_traceback_and_a_crash_leaves_none(linear_case):
    case_id, case = linear_case
    for target, kind in (("test_target_traceback:RaisesWhileLoading", FailureKind.RAISED), (f"misbehaving_targets:{Aborts.__name__}", FailureKind.CRASHED)):
        executor = IsolatedExecutor(target, case_timeout=120)
        try:
            result = OP.run(SimpleNamespace(executor=executor, repeat=1, require_deterministic=False), case_id, case)
        finally:
            executor.close()
        assert (result.outcome, result.kinds) == (Outcome.BROKEN, (kind,)), result.message
        if kind is FailureKind.CRASHED:  # nothing was raised: no traceback is made up
            assert result.traceback is None and "traceback" not in result.to_json() and result.raised is None
        else:
            assert result.raised == {"type": "RuntimeError", "frame": "test_target_traceback.py:RaisesWhileLoading.__init__"}
            assert [function for _, function in frames(result.traceback)][-1] == "__init__", result.traceback
            assert result.traceback.endswith("RuntimeError: no device found while loading the target")
