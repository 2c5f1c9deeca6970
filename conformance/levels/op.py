"""Op cases (design levels 1 and 2: the kernels and the PunicaWrapper methods): one op on one drawn batch.

The values are drawn here, in the referee's process, from the case's seed (or read from a replay); the
target's worker calls the op (``conformance.target_call``) and hands back everything it was given; the
verdict is reached here (``conformance.referee``). A failure the target reported is attempted a second
time (flaky or consistent). A failing case leaves a replay file, whose command is its repro, and with
``--shrink`` the smallest case failing the same way.

A wrapper op the target does not implement is "not supported" from its facts, before any value is drawn
or the worker starts (:meth:`OpKind.unsupported_reason`); everything else the worker's
``call_target`` decides on the loaded target (its ``implemented_ops()``, then its ``unsupported_reason``).
"""

from __future__ import annotations

import time

from conformance.cases.case import Case
from conformance.cases.features import case_features
from conformance.cases.replay import write_replay
from conformance.digest import tensors_digest
from conformance.generator import PROFILES, profile_cases
from conformance.isolation import Breakdown
from conformance.levels.context import LevelContext
from conformance.ops import OP_SPECS, Level
from conformance.record import CaseResult
from conformance.runner import PROCESS_LOST, attempted, make_values
from conformance.target_call import answer, handed_tensors, reply_limits, request
from conformance.targets.facts import TargetFacts
from conformance.verdict import FailureKind, Outcome

from .base import BREAKDOWNS, CaseKind, breakdown_message


class OpKind(CaseKind):
    name = "op"
    target_half = "conformance.target_call:serve"
    markers = {
        Level.KERNEL.value: "a kernel-level op case (design level 1)",
        Level.WRAPPER.value: "a PunicaWrapper-level op case (design level 2)",
    }

    def owns(self, case) -> bool:
        return isinstance(case, Case)

    def cases(self, profile: str, seed: int) -> list[tuple[str, Case]]:
        return profile_cases(profile, seed)

    def case_from_json(self, data: dict) -> Case:
        return Case.from_json(data)

    def inputs_digest(self, case: Case) -> str:
        return tensors_digest(make_values(case))

    def marks(self, case: Case) -> tuple[str, ...]:
        return (OP_SPECS[case.op].level.value,)

    def features(self, case: Case) -> frozenset[str]:
        return case_features(case)

    def unsupported_reason(self, facts: TargetFacts, case: Case) -> str | None:
        """A wrapper op the target does not implement, in the words its worker would use (``not_implemented_reason``).

        Kernel ops and every other refusal stay with the worker: a target may bind its kernels when it
        is made (the cpu target's torch ops), which its class's facts cannot see, while wrapper methods
        live on the class; and a dtype or case refusal is the target's own ``unsupported_reason``, in its
        own words (the cuda target's fp8 ops take float32 outputs though it claims no float32).
        """
        if OP_SPECS[case.op].level is Level.WRAPPER and not facts.defines(case.op):
            return facts.why_not_implemented.get(case.op, f"{facts.name} does not implement {case.op}")
        return None

    def run(self, context: LevelContext, case_id: str, case: Case, values=None, *, runs: int | None = None,
            second_attempt: bool = True) -> CaseResult:
        """The values drawn here (once, for every call and attempt), the target called in its worker, its answer read
        as data (``conformance.target_call.answer``) and judged here; a failure the target reported is attempted a
        second time, and a breakdown of that attempt makes the case flaky."""
        values = make_values(case) if values is None else values
        runs = context.repeat if runs is None else runs
        expected = handed_tensors(OP_SPECS[case.op], case, values)
        sent, limits = request(case, values, runs), reply_limits(expected, runs)

        def call():
            return context.executor.call(self.name, self.target_half, case_id, sent, limits=limits, parse=lambda data: answer(data, expected, runs))

        started = time.perf_counter()
        try:
            return attempted(call, case, case_id, values, require_deterministic=context.require_deterministic,
                             second_attempt=second_attempt, breakdowns=BREAKDOWNS, expected=expected)
        except BREAKDOWNS as exc:  # the first attempt: the case did not return
            return self.broken_by(exc, case_id, case, time.perf_counter() - started)

    def after_failure(self, context: LevelContext, result: CaseResult, values=None) -> dict | None:
        """A replay file of the case (the repro replays it) and, with ``--shrink``, the shrunk case's."""
        case = result.case
        path = write_replay(
            context.report_dir / "replays", result.case_id, case, make_values(case) if values is None else values,
            target=context.target_name, outcome=result.outcome.value, message=result.message, suite_version=context.suite_version,
        )
        result.replay = str(path)
        result.repro = context.repro_command(path)
        if context.shrink and result.outcome is not Outcome.KNOWN_FAILURE:
            return self.add_shrunk_case(context, result)
        return None

    def add_shrunk_case(self, context: LevelContext, result: CaseResult) -> dict | None:
        """Shrink a failure; the shrunk case's replay, repro and structure (the record's ``shrunk``), or None."""
        if result.kind in PROCESS_LOST:
            result.message += " (not shrunk: every candidate of a crash, a hang or a refused reply would need a process of its own)"
            return None
        try:
            smallest = self._shrink(context, result)
        except BREAKDOWNS as exc:
            result.message += f" (shrinking stopped: {breakdown_message(exc)})"
            return None
        if smallest is None:
            result.message += " (shrinking found no smaller case failing the same way)"
            return None
        path = write_replay(
            context.report_dir / "replays", f"{result.case_id}.shrunk", smallest, make_values(smallest),
            target=context.target_name, shrunk_from=result.case_id, suite_version=context.suite_version,
        )
        shape = f"{len(smallest.seq_lens)} sequences, {smallest.num_tokens} tokens, {smallest.num_slots} slots, rank {smallest.max_rank}"
        result.repro = f"{result.repro}\nshrunk ({shape}): {context.repro_command(path)}"
        # structured, so that a cluster's smallest case can be the shrunk one without reading the repro text
        return {"replay": str(path), "repro": context.repro_command(path), "case": smallest.to_json()}

    def _shrink(self, context: LevelContext, failing: CaseResult) -> Case | None:
        """Hypothesis searches here; each candidate's target call goes to the worker and is judged here, one
        call and one attempt each; the search stops after 20 case timeouts."""
        # Hypothesis loads only here: a run never needs it otherwise once its profile's cases are in the
        # disk cache, and its import costs seconds per process (conformance.generator.cache).
        from conformance import hypothesis_profile
        from conformance.shrinking import shrink_failure

        hypothesis_profile.load()
        timeout = context.case_timeout
        deadline = time.monotonic() + 20 * timeout if timeout else None

        def judged(candidate: Case) -> CaseResult:
            if deadline is not None and time.monotonic() > deadline:
                raise Breakdown(FailureKind.TIMED_OUT, f"the search outlasted 20 case timeouts ({20 * timeout:g} s)")
            return self.run(context, candidate.case_id, candidate, runs=1, second_attempt=False)

        return shrink_failure(judged, failing, PROFILES[context.profile].limits)


OP = OpKind()
