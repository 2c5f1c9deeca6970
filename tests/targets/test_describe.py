"""``describe`` probes every knob a case varies, so a refusal that depends on one knob shows before a run."""

from __future__ import annotations

from conformance.ops import KNOBS
from conformance.targets.describe import FEATURE_PROBES, describe, describe_class, render
from conformance.targets.hpu.targets import HpuEmulatedTarget


def test_every_knob_a_case_varies_has_a_probe():
    probed = {knob for _, knob, _ in FEATURE_PROBES if knob is not None}
    assert probed == set(KNOBS), f"knobs without a describe probe: {sorted(set(KNOBS) - probed)}"


class RefusesWhatItDoesNotDo(HpuEmulatedTarget):
    """A backend that has no add_inputs=False path, no offset and no scale other than 1 yet."""

    name = "refuses-some-knobs"

    def unsupported_reason(self, case):
        if (reason := super().unsupported_reason(case)) is not None:
            return reason
        if not case.add_inputs:
            return "no overwrite path yet"
        if case.offset_start:
            return "no column offset yet"
        if case.scale != 1.0:
            return "scale is applied by the caller"
        if case.dtype == "float32" and case.hidden_size % 2:
            return "odd hidden sizes need a tail loop"
        return None


def test_a_refusal_of_one_knob_is_a_note_on_the_ops_that_read_it():
    statuses = {(s.op, s.dtype): s for s in describe_class(RefusesWhatItDoesNotDo).statuses}
    expand = statuses["bgmv_expand_slice", "float16"]
    assert expand.supported and "add_inputs=False not supported: no overwrite path yet" in expand.status
    assert "an output offset not supported: no column offset yet" in expand.status
    shrink = statuses["bgmv_shrink", "float32"]
    assert "a scale other than 1 not supported" in shrink.status and "an odd hidden size not supported" in shrink.status
    assert "an output offset" not in shrink.status  # shrink does not read the offset: no note
    assert "odd hidden" not in statuses["bgmv_shrink", "float16"].status


def test_describe_names_a_module_class_target_by_its_short_name_with_the_reference_that_loads_it():
    described = describe(f"{__name__}:RefusesWhatItDoesNotDo")
    assert (described.name, described.reference) == ("refuses-some-knobs", f"{__name__}:RefusesWhatItDoesNotDo")
    # before: the reference twice, "test_describe:RefusesWhatItDoesNotDo  (test_describe:RefusesWhatItDoesNotDo)"
    assert render(described).splitlines()[0] == f"refuses-some-knobs  ({__name__}:RefusesWhatItDoesNotDo)"
    registered = describe("reference")
    assert (registered.name, registered.reference) == ("reference", "conformance.targets.reference:ReferenceTarget")


def test_a_target_that_cannot_run_here_says_so_first_and_last():
    """``describe cuda`` on a machine without a GPU read as if the target were usable (issue 35): 66 status
    lines of what its class defines between one "no" and a count. Here it says it is unusable, and why, in
    its first status line and its last line; where torch sees a GPU it says it can run."""
    import torch

    description = describe("cuda")
    lines = render(description).splitlines()
    if torch.cuda.is_available():
        assert description.usable and "can run here: yes" in lines
        return
    assert not description.usable and "no CUDA device is visible" in description.reason
    assert "torch.cuda.is_available() is False" in description.reason and torch.__version__ in description.reason
    [verdict] = [line for line in lines if line.startswith("can run here:")]
    assert verdict.startswith("can run here: NO, cuda is unusable on this machine: ") and description.reason in verdict
    assert lines[-1].startswith("cuda is unusable on this machine") and lines[-2].startswith("supported: 0 of ")
    assert "pip install vllm==0.33.0" in description.reason and "scripts/device-kit cuda" in description.reason


def test_a_usable_target_has_no_unusable_line():
    lines = render(describe("reference")).splitlines()
    assert "can run here: yes" in lines and lines[-1].startswith("supported: ")
