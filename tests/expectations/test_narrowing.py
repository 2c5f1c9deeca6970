"""An expectations entry must narrow what it covers: one that names no op, kind, symptom or feature
would turn every failure of the target into a known failure, and its gate would pass on anything.

``load_expectations`` refuses such an entry, naming it and the fields that narrow; every shipped file
must still load.
"""

from __future__ import annotations

import pytest

from conformance.expectations import FAIL_KINDS, SHIPPED_DIR, load_expectations

HEAD = 'reason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\n'


def _load(tmp_path, *entries: str):
    path = tmp_path / "e.toml"
    path.write_text("".join(f'[[known_failure]]\nid = "{entry_id}"\n{HEAD}{fields}' for entry_id, fields in entries))
    return load_expectations(path)


EVERY_FAIL_KIND = "kinds = [" + ", ".join(f'"{kind.value}"' for kind in sorted(FAIL_KINDS, key=str)) + "]\n"


@pytest.mark.parametrize(
    "fields",
    [
        "",  # nothing: every failure of every case
        'ops = ["*"]\n',  # a pattern that matches every op narrows nothing
        'ops = ["bgmv_*", "**"]\n',
        'dtypes = ["bfloat16"]\nversions = { vllm = "<0.33" }\n',  # neither names what fails
        'features_none = ["decode"]\n',  # leaves nearly every case in
        EVERY_FAIL_KIND,  # what an entry without kinds covers anyway
    ],
    ids=["nothing", "ops-star", "ops-with-a-star", "dtypes-versions", "features-none", "every-fail-kind"],
)
def test_an_entry_that_narrows_nothing_is_refused_by_id(tmp_path, fields):
    with pytest.raises(ValueError) as caught:
        _load(tmp_path, ("narrow", 'ops = ["bgmv_shrink"]\n'), ("catch-all", fields))
    message = str(caught.value)
    assert "entry 2" in message and "'catch-all'" in message and "every failure" in message
    for field in ("ops", "kinds", "failing_rows", "features_all", "features_any"):
        assert field in message  # the fix: which fields narrow an entry


@pytest.mark.parametrize(
    "fields",
    [
        'ops = ["bgmv_*"]\n',
        'kinds = ["raised"]\n',
        'failing_rows = "no-adapter"\n',
        'features_all = ["decode"]\n',
        'features_any = ["neg1", "allneg1"]\n',
        'ops = ["*"]\nfeatures_any = ["neg1"]\n',
    ],
    ids=["ops", "kinds", "failing-rows", "features-all", "features-any", "ops-star-and-feature"],
)
def test_an_entry_narrowed_by_op_kind_symptom_or_feature_loads(tmp_path, fields):
    [entry] = _load(tmp_path, ("narrow", fields))
    assert entry.id == "narrow"


@pytest.mark.parametrize("path", sorted(SHIPPED_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_file_loads(path):
    assert load_expectations(path)
