"""Every level is a kind of one case (``conformance.levels``): adding one is a module and its cases.

The level below lives in this file alone: a ``CaseKind`` with its cases (a "sum" of a few numbers the
target's worker adds up with torch), run through the worker like any op, judged here. The session lists,
runs, journals, reports and gates it with no change anywhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from conformance.levels import KINDS, LAYER, MODEL, OP, CaseKind, kind_of
from conformance.record import CaseResult
from conformance.session import ConformanceRun, RunSettings
from conformance.verdict import FailureKind, Outcome


@dataclass(frozen=True)
class SumCase:
    """A case of the toy level: the target must report the sum of ``terms``."""

    case_id: str
    terms: tuple[float, ...]
    op: str = "sum"
    dtype: str = "float64"
    family: str = "toy"

    def features(self) -> frozenset[str]:
        return frozenset({f"terms{len(self.terms)}"})

    def to_json(self) -> dict:
        return {"case_id": self.case_id, "terms": list(self.terms)}


@dataclass
class SumResult(CaseResult):
    @property
    def level(self):
        from conformance.ops import Level

        return Level.MODEL  # a level's record names its level; a real new level adds its own value


class SumKind(CaseKind):
    name = "sum"
    markers = {"toy": "the toy level of tests/test_levels.py"}
    result_type = SumResult

    def owns(self, case) -> bool:
        return isinstance(case, SumCase)

    def cases(self, profile: str, seed: int) -> list[tuple[str, SumCase]]:
        return [(f"sum-{n}", SumCase(f"sum-{n}", tuple(float(i) for i in range(n)))) for n in (1, 3, 5)]

    def run(self, run, case_id: str, case: SumCase, values=None) -> CaseResult:
        expected = sum(case.terms)
        got = float(torch.tensor(case.terms, dtype=torch.float64).sum())  # the "target": the point is the plumbing
        outcome = Outcome.PASS if got == expected else Outcome.FAIL
        return SumResult(case_id, case, outcome, "" if outcome is Outcome.PASS else f"{got} != {expected}",
                         features=self.features(case))


def test_the_built_in_levels_own_their_cases_and_nothing_else():
    assert {kind.name for kind in KINDS} == {"op", "layer", "model"}
    for kind in KINDS:
        case_id, case = kind.cases("smoke", 0)[0]
        assert kind_of(case) is kind and case_id
        assert set(kind.marks(case)) <= set(kind.markers)
    assert kind_of(OP.cases("smoke", 0)[0][1]) is OP and kind_of(LAYER.cases("smoke", 0)[0][1]) is LAYER
    assert kind_of(MODEL.cases("smoke", 0)[0][1]) is MODEL


def test_a_new_level_is_one_module_and_its_cases(tmp_path):
    run = ConformanceRun(RunSettings(target="reference", profile="smoke", report_dir=str(tmp_path)), kinds=(SumKind(),))
    document = run.run_all()
    assert document["gate"]["passed"], document["gate"]
    assert [r["id"] for r in document["results"]] == ["sum-1", "sum-3", "sum-5"]
    assert document["expected"] == ["sum-1", "sum-3", "sum-5"] and document["missing"] == []
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["case_list"]["count"] == 3
    matrix = (tmp_path / "report.html").read_text().split('id="matrix"')[1].split("</table>")[0]
    assert "sum" in matrix and "3 pass" in (tmp_path / "report.html").read_text()
    # a case that did not return is broken at its own level
    broken = run.broken("sum-3", SumKind().cases("smoke", 0)[1][1], FailureKind.CRASHED, "gone")
    assert isinstance(broken, SumResult) and broken.outcome is Outcome.BROKEN
