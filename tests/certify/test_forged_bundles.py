"""verify against forged bundles: each forgery is refused with exit 2, naming what is wrong and where.

Every bundle here is synthetic and built in this process (tests/certify/bundles.py); the forger redoes
what certify would after each edit (record digests, verdict, certificate, hash index) except what the
test is about, so each test sees the one check its forgery cannot pass, and asserts that check's finding
is the only one.
"""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from bundles import (
    CASES,
    FAILING,
    PASSING,
    central_waiver,
    forged,
    known_failure_records,
    members_of,
    passing_records,
    record,
    results_of,
    write,
    write_list,
)

from conformance.certify import archive
from conformance.certify.bundle import BUNDLE, CERTIFICATE, STATEMENT
from conformance.certify.commands import verify_main
from conformance.certify.statement import VENDOR_FIELDS, template
from conformance.certify.verify import verify_bundle
from conformance.expectations import load_expectations


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lists")
    caselist = write_list(directory)
    return caselist, {"mini": caselist.path}


@pytest.fixture(scope="module")
def good(mini):
    caselist, released = mini
    return members_of(caselist, passing_records(), released)


def verified(members, released, tmp_path, **options):
    check = verify_bundle(write(members, tmp_path / "bundle.tar.gz"), released=released, **options)
    return check, [finding.line() for finding in check.findings]


def only_invalid(check, lines, *fragments):
    """The bundle is invalid, with exactly one finding, which says every fragment."""
    assert check.exit_code == 2, lines
    assert len(lines) == 1, lines
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


def test_a_good_bundle_is_conformant(good, mini, tmp_path):
    check, lines = verified(good, mini[1], tmp_path)
    assert (check.exit_code, lines) == (0, [])
    assert check.verdict == "conformant"
    assert "statement: not filled (empty: company, contact" in " ".join(check.notes)
    header = json.loads(good[BUNDLE])
    assert header["verdict"] == {"verdict": "conformant", "findings": []}
    assert header["caselist"] == {"name": "mini", "digest": mini[0].digest, "count": len(CASES)}
    assert set(good) == {"bundle.json", "results.json", "digests.json", "waivers.json", "statement.toml", "certificate.html",
                         "index.json", "manifests/input-1.json"}
    assert "CONFORMANT" in good[CERTIFICATE].decode()


def test_the_same_inputs_give_the_same_bundle_bytes(good, mini, tmp_path):
    again = members_of(mini[0], passing_records(), mini[1])
    assert write(good, tmp_path / "a.tar.gz").read_bytes() == write(again, tmp_path / "b.tar.gz").read_bytes()


def test_an_unwaived_failure_is_not_conformant(mini, tmp_path):
    records = passing_records()
    records[0] = record(0, "fail", FAILING, ("numerics",))
    check, lines = verified(members_of(mini[0], records, mini[1]), mini[1], tmp_path)
    assert check.exit_code == 1
    assert lines == [f"not conformant: results.json: 1 case(s) ended 'fail', which no central waiver covers: {CASES[0][0]}"]
    assert json.loads(members_of(mini[0], records, mini[1])[BUNDLE])["verdict"]["verdict"] == "not conformant"


def test_a_known_failure_under_a_central_waiver_is_conformant(mini, tmp_path):
    members = members_of(mini[0], known_failure_records(central_waiver()), mini[1])
    check, lines = verified(members, mini[1], tmp_path)
    assert (check.exit_code, lines) == (0, [])
    [used] = json.loads(members["waivers.json"])["used"]
    assert used["entry"]["id"] == "vllm-cpu-add-lora-linear-add-inputs" and used["known failure"] == [CASES[3][0]]
    assert "vllm-cpu-add-lora-linear-add-inputs" in members[CERTIFICATE].decode()


def local_waiver(tmp_path) -> dict:
    path = tmp_path / "mine.toml"
    path.write_text('[[known_failure]]\nid = "mine"\nreason = "our own"\nupstream = ["https://example.com/1"]\n'
                    'expires = 2027-01-01\nops = ["add_lora_linear"]\nkinds = ["raised"]\n')
    [entry] = load_expectations(path)
    return entry.to_json()


def test_a_known_failure_under_a_local_waiver_is_not_conformant(mini, tmp_path):
    members = members_of(mini[0], known_failure_records(local_waiver(tmp_path)), mini[1])
    check, lines = verified(members, mini[1], tmp_path)
    assert check.exit_code == 1, lines
    [line] = lines
    assert line.startswith(f"not conformant: results.json record {CASES[3][0]}: a known failure under a local waiver")
    assert "'mine' is a local waiver" in line


# --- the forgeries of issue 34 -----------------------------------------------------------------------


def test_an_edited_outcome_fail_to_pass_with_its_measurement_left(mini, tmp_path):
    records = passing_records()
    records[0] = record(0, "fail", FAILING, ("numerics",))
    members = members_of(mini[0], records, mini[1])

    def to_pass(doc):
        doc["results"][0].update(outcome="pass", kind=None, kinds=[])

    check, lines = verified(forged(members, to_pass, mini[1]), mini[1], tmp_path)
    only_invalid(check, lines, f"results.json record {CASES[0][0]}", "recorded pass", "budget_ratio 41750",
                 "the error exceeds its budget")


def test_a_pass_made_of_a_fail_whose_measurement_was_edited_but_not_its_digest(mini, tmp_path):
    records = passing_records()
    records[0] = record(0, "fail", FAILING, ("numerics",))
    members = members_of(mini[0], records, mini[1])

    def to_pass(doc):
        doc["results"][0].update(outcome="pass", kind=None, kinds=[], measurement=dict(PASSING))

    check, lines = verified(forged(members, to_pass, mini[1], redigest=False), mini[1], tmp_path)
    only_invalid(check, lines, f"results.json record {CASES[0][0]}", "its digest recomputes to sha256:", "was changed after it was digested")


def test_a_fail_whose_numbers_pass(good, mini, tmp_path):
    def to_fail(doc):
        doc["results"][2].update(outcome="fail", kind="numerics", kinds=["numerics"])

    check, lines = verified(forged(good, to_fail, mini[1]), mini[1], tmp_path)
    assert check.exit_code == 2
    assert any(f"record {CASES[2][0]}: recorded kind 'numerics', but its measurement" in line for line in lines), lines


def test_a_dropped_case(good, mini, tmp_path):
    def drop(doc):
        del doc["results"][4]

    check, lines = verified(forged(good, drop, mini[1]), mini[1], tmp_path)
    only_invalid(check, lines, "results.json: 1 case(s) of list 'mini' have no result", CASES[4][0])


def test_a_duplicated_case(good, mini, tmp_path):
    def duplicate(doc):
        doc["results"].append(dict(doc["results"][1]))

    check, lines = verified(forged(good, duplicate, mini[1]), mini[1], tmp_path)
    assert check.exit_code == 2
    assert f"invalid: results.json: 1 case(s) have more than one result: {CASES[1][0]}" in lines, lines


def test_swapped_inputs(good, mini, tmp_path):
    def swap(doc):
        doc["results"][1]["inputs_digest"] = doc["results"][2]["inputs_digest"]

    check, lines = verified(forged(good, swap, mini[1]), mini[1], tmp_path)
    only_invalid(check, lines, f"results.json record {CASES[1][0]}", "judged on inputs", "not of this case's inputs")


def test_another_case_under_a_listed_id(good, mini, tmp_path):
    def other_case(doc):
        doc["results"][1]["case"]["hidden_size"] = 4096

    check, lines = verified(forged(good, other_case, mini[1]), mini[1], tmp_path)
    only_invalid(check, lines, f"results.json record {CASES[1][0]}", "'hidden_size' = 4096", "another case under this id")


def test_a_local_waiver_presented_as_central(mini, tmp_path):
    members = members_of(mini[0], known_failure_records(local_waiver(tmp_path)), mini[1])

    def relabel(doc):
        doc["results"][3]["expectation"].update(source="central", file="conformance/expectations/cpu.toml")

    check, lines = verified(forged(members, relabel, mini[1]), mini[1], tmp_path)
    assert check.exit_code == 2, lines
    assert any(line.startswith(f"invalid: results.json record {CASES[3][0]}: its waiver is presented as central") for line in lines), lines
    assert any("waivers.json" in line for line in lines), lines  # the waivers listed are no longer the records'


def test_a_central_waiver_stretched_over_a_case_it_does_not_cover(mini, tmp_path):
    records = passing_records()
    records[0] = record(0, "known failure", FAILING, ("numerics",), central_waiver())
    check, lines = verified(members_of(mini[0], records, mini[1]), mini[1], tmp_path)
    only_invalid(check, lines, f"record {CASES[0][0]}", "presented as central", "does not cover case")


def test_a_bundle_naming_an_unreleased_list(good, mini, tmp_path):
    check, lines = verified(good, {}, tmp_path)
    only_invalid(check, lines, "invalid: caselist:", "'mini', which this suite release does not ship")


def test_a_bundle_naming_an_edited_list(good, mini, tmp_path):
    edited = write_list(tmp_path)  # the same name and cases, one input changed: another digest
    lines = edited.path.read_text().splitlines()
    lines[1] = lines[1].replace(edited.entries[0].inputs_digest, "sha256:" + "f" * 64)
    from conformance.caselists.caselist import lines_digest

    header = json.loads(lines[0])
    header["digest"] = lines_digest(lines[1:])
    edited.path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    check, findings = verified(good, {"mini": edited.path}, tmp_path)
    only_invalid(check, findings, "invalid: caselist:", f"digest {mini[0].digest}", "the cases were edited, or come from another release")


def test_a_broken_hash_index(good, mini, tmp_path):
    def quietly(doc):
        doc["results"][0]["seconds"] = 99.0  # no digest covers it; the index does

    check, lines = verified(forged(good, quietly, mini[1], redigest=False, reindex=False), mini[1], tmp_path)
    only_invalid(check, lines, "invalid: index.json: results.json: its bytes do not match index.json")


def test_a_file_added_after_indexing_and_one_removed(good, mini, tmp_path):
    members = {**good, "notes.txt": b"trust me"}
    del members[CERTIFICATE]
    check, lines = verified(members, mini[1], tmp_path)
    assert check.exit_code == 2
    assert "invalid: index.json: index.json lists 'certificate.html', which the bundle does not hold" in lines
    assert "invalid: index.json: notes.txt: not listed in index.json (a file added after the bundle was indexed)" in lines


def test_an_edited_certificate(good, mini, tmp_path):
    members = archive.with_index({**good, CERTIFICATE: good[CERTIFICATE].replace(b"synthetic", b"another-chip")})
    check, lines = verified(members, mini[1], tmp_path)
    only_invalid(check, lines, "invalid: certificate.html:", "says more or other than the bundle")


def test_a_verdict_claimed_over_the_data(mini, tmp_path):
    records = passing_records()
    records[0] = record(0, "fail", FAILING, ("numerics",))
    members = members_of(mini[0], records, mini[1])
    header = json.loads(members[BUNDLE])
    header["verdict"] = {"verdict": "conformant", "findings": []}
    members = archive.with_index({**members, BUNDLE: json.dumps(header).encode()})
    check, lines = verified(members, mini[1], tmp_path)
    assert check.exit_code == 2
    assert any(line.startswith("invalid: bundle.json: it records the verdict 'conformant'") for line in lines), lines


# --- the archive itself --------------------------------------------------------------------------------


def tar_with(path, extra: list[tarfile.TarInfo], members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return path


def test_unsafe_members_are_named_and_never_read(good, mini, tmp_path):
    link = tarfile.TarInfo("results-link.json")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    climbing, absolute, again = tarfile.TarInfo("../outside.json"), tarfile.TarInfo("/abs.json"), tarfile.TarInfo(STATEMENT)
    for info in (climbing, absolute, again):
        info.size = 1
    path = tar_with(tmp_path / "unsafe.tar.gz", [link, climbing, absolute, again], good)
    check = verify_bundle(path, released=mini[1])
    lines = [finding.line() for finding in check.findings]
    assert check.exit_code == 2
    assert "invalid: archive: member 'results-link.json': a symbolic link to '/etc/passwd', not a regular file" in lines
    assert "invalid: archive: member '../outside.json': a path with '..'" in lines
    assert "invalid: archive: member '/abs.json': an absolute path" in lines
    assert "invalid: archive: member 'statement.toml': a second member of that name (it would replace the first on extraction)" in lines


def test_an_oversized_member_is_refused_unread(good, mini, tmp_path, monkeypatch):
    monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 1000)
    check = verify_bundle(write(good, tmp_path / "b.tar.gz"), released=mini[1])
    assert any("member 'results.json':" in f.what and "over the 1,000-byte limit" in f.what for f in check.findings)


def test_a_file_that_is_no_bundle(tmp_path, mini):
    (tmp_path / "not.tar.gz").write_bytes(b"hello")
    check = verify_bundle(tmp_path / "not.tar.gz", released=mini[1])
    assert check.exit_code == 2 and check.findings[0].where == "archive" and "not a .tar.gz bundle" in check.findings[0].what


# --- the statement and the command line ----------------------------------------------------------------


def filled(target="synthetic", digest=None, caselist=None) -> bytes:
    text = template(target, caselist.name, digest or caselist.digest).decode()
    for name in VENDOR_FIELDS:
        text = text.replace(f'{name} = ""', f'{name} = "{name} of the vendor"')
    return text.encode()


def test_a_filled_statement_is_reported_filled(mini, tmp_path):
    members = members_of(mini[0], passing_records(), mini[1], statement=filled(caselist=mini[0]))
    check, lines = verified(members, mini[1], tmp_path)
    assert (check.exit_code, lines) == (0, [])
    assert "statement: filled" in check.notes


def test_a_statement_about_another_bundle(mini, tmp_path):
    members = members_of(mini[0], passing_records(), mini[1], statement=filled(target="another-chip", caselist=mini[0]))
    check, lines = verified(members, mini[1], tmp_path)
    only_invalid(check, lines, "invalid: statement.toml: target = 'another-chip', but the bundle is of 'synthetic'")


def test_verify_prints_every_problem_and_exits_2(good, mini, tmp_path, monkeypatch, capsys):
    import conformance.caselists

    monkeypatch.setattr(conformance.caselists, "released_caselists", lambda: mini[1])

    def two_edits(doc):
        del doc["results"][4]
        doc["results"][1]["inputs_digest"] = doc["results"][2]["inputs_digest"]

    path = write(forged(good, two_edits, mini[1]), tmp_path / "b.tar.gz")
    assert verify_main([str(path)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("verdict: INVALID — target synthetic, case list mini")
    assert sum(line.startswith("invalid: ") for line in out) == 2, out
    assert verify_main([str(write(good, tmp_path / "good.tar.gz"))]) == 0


def test_rejudge_compares_the_recorded_oracle_with_one_computed_again(good, mini, tmp_path, monkeypatch):
    import conformance.caselists

    monkeypatch.setattr(conformance.caselists, "released_caselists", lambda: mini[1])
    recorded = {r["id"]: r for r in results_of(good)["results"]}
    monkeypatch.setattr(conformance.caselists, "rejudge_entry",
                        lambda entry: {"inputs_digest": entry.inputs_digest, "oracle_fingerprint": recorded[entry.case_id]["oracle_fingerprint"]})
    check, lines = verified(good, mini[1], tmp_path, rejudge=3, seed=7)
    assert (check.exit_code, lines) == (0, [])
    [note] = [n for n in check.notes if n.startswith("rejudge:")]
    assert "3 case(s) of mini, seed 7" in note
    assert note == verified(good, mini[1], tmp_path, rejudge=3, seed=7)[0].notes[-1]  # the seed repeats the sample

    monkeypatch.setattr(conformance.caselists, "rejudge_entry",
                        lambda entry: {"inputs_digest": entry.inputs_digest, "oracle_fingerprint": [64.0, 0.0, 9.0, 20.0, 12.0, 0.75]})
    check, lines = verified(good, mini[1], tmp_path, rejudge=len(CASES), seed=1)
    assert check.exit_code == 2 and len(lines) == len(CASES)
    assert all(line.startswith("invalid: rejudge op:") and "not judged against this case's oracle" in line for line in lines)


def test_an_infinite_measurement_is_digested(mini, tmp_path):
    """An end-to-end case whose target gave a token no probability records an infinite log-prob error
    (``Infinity`` in results.json): its digest writes it as the string ``inf``, as the op measurement does."""
    records = passing_records()
    records[5] = record(5, "fail", {"max_logprob_error": float("inf"), "budget_ratio": float("inf")}, ("generated other tokens",))
    check, lines = verified(members_of(mini[0], records, mini[1]), mini[1], tmp_path)
    assert check.exit_code == 1 and lines == [f"not conformant: results.json: 1 case(s) ended 'fail', which no central waiver covers: {CASES[5][0]}"]
