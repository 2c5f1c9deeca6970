"""Running tensor-parallel cases on a target and recording them: the executor the session calls.

:class:`TPExecutor` keeps one :class:`conformance.tp.pool.RankPool` (the ranks of one TP size; a case
of another size ends it first: two cores do not hold eight idle ranks well), sends each case to its
ranks, judges rank 0's gathered output (``conformance.tp.judgement``) and turns whatever happened into
a :class:`TPResult`, a ``CaseResult`` at level ``layer``. A target runs the cases iff it implements
the wrapper methods its layer calls (vLLM's linear LoRA layers: ``add_shrink``, ``add_expand``,
``add_lora_linear``; the MoE LoRA layer: ``add_lora_w13``, ``add_lora_w2``), decided from its facts (``conformance.targets.facts``: this process, the
referee's, never imports the target), so an unsupported target never starts a pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from conformance.devices import visible_device_ids
from conformance.ops import Level
from conformance.record import CaseResult
from conformance.targets.device_traits import DeviceTraits
from conformance.targets.facts import TargetFacts
from conformance.verdict import FailureKind, Outcome
from conformance.verdict.failure_kind import ordered
from conformance.verdict.metrics import spread

from .case import TPCase
from .composition import required_methods, tensors_of
from .judgement import judge_output
from .layer_wire import RankAnswer
from .moe_case import MoETPCase
from .placement import Placement, place_ranks
from .pool import RankFailure, RankPool

TP_CASE_TIMEOUT = 120.0  # seconds: a TP case takes about a second; the profile's timeout is sized for op workers


@dataclass
class TPResult(CaseResult):
    """One tensor-parallel case's result: an op case's record at level "layer", with the ranks a failure names and
    where its ranks ran (``placement``: ``conformance.tp.placement.Placement.to_json``; None where no rank started)."""

    case: TPCase | MoETPCase
    failing_ranks: tuple[int, ...] = ()
    placement: dict | None = None

    @property
    def level(self) -> Level:
        return Level.LAYER

    def to_json(self) -> dict:
        record = {**super().to_json(), "failing_ranks": list(self.failing_ranks)}
        if self.placement is not None:
            record["placement"] = self.placement
        return record


def unsupported_reason(facts: TargetFacts, case: TPCase | MoETPCase) -> str | None:
    """Why the target does not run ``case``, from its facts (no target is loaded for this)."""
    required = required_methods(case)
    missing = [m for m in required if not facts.defines(m)]
    if missing:
        layers = "MoE LoRA layer calls" if isinstance(case, MoETPCase) else "linear LoRA layers call"
        why = [f"{m}: {facts.why_not_implemented[m]}" for m in missing if m in facts.why_not_implemented]
        return (f"{facts.name} does not implement {', '.join(missing)} (the tensor-parallel {layers} "
                f"{', '.join(required)} on each rank)" + (f"; {'; '.join(why)}" if why else ""))
    if not facts.claims(case.dtype):
        return f"{facts.name} does not support {case.dtype}"
    if facts.distributed_backend is None:
        return (f"{facts.name} runs on {facts.device_type}, for which no torch.distributed backend is known: its target "
                f"class states one in device_traits() (conformance.targets.device_traits.DeviceTraits) to run tensor-parallel cases")
    return None


class TPExecutor:
    def __init__(self, target_name: str, facts: TargetFacts, *, case_timeout: float | None, torch_threads: int = 1,
                 devices: str | list[str] | None = None, device_env: str | None = None, runs: int = 1,
                 require_deterministic: bool = False) -> None:
        self.target_name = target_name
        self.facts = facts
        self.runs = runs  # calls per case on the same pool, compared bit for bit (--repeat)
        self.require_deterministic = require_deterministic  # a nondeterministic pass fails
        self.case_timeout = None if not case_timeout else min(case_timeout, TP_CASE_TIMEOUT)
        self.torch_threads = torch_threads
        self.devices, self.device_env = devices, device_env
        self._pool: RankPool | None = None
        self._start_errors: dict[int, RankFailure] = {}  # a pool that cannot start: said once per case, not retried
        self._visible: list[list[str] | None] | None = None  # [the device ids that exist here], once counted
        self.pool_starts = 0
        self.leftover_processes: list[str] = []  # what the target left running in its ranks' process groups (killed)

    def placement(self, tp_size: int) -> Placement:
        """Where ``tp_size`` ranks of this target run (``conformance.tp.placement``), from the devices that exist
        here (``conformance.devices.visible_device_ids``, counted once per executor)."""
        facts = self.facts
        if self._visible is None:
            variable = self.device_env or facts.visible_devices_env
            self._visible = [visible_device_ids(facts.device_type, variable, facts.reference.partition(":")[0])]
        traits = DeviceTraits(facts.device_type, facts.visible_devices_env, facts.distributed_backend)
        return place_ranks(tp_size, self._visible[0], traits, self.devices, self.device_env)

    def _pool_for(self, tp_size: int, placement: Placement) -> RankPool:
        if self._pool is not None and self._pool.tp_size != tp_size:
            self.close()
        if self._pool is None:
            self._pool = RankPool(self.target_name, tp_size, torch_threads=self.torch_threads, placement=placement)
        return self._pool

    def run(self, case: TPCase | MoETPCase) -> TPResult:
        """The case's result; ``ValueError`` where its ranks cannot be placed (``--devices``, no device: the run's
        options or machine, not the target). Every result of a case whose ranks were placed records where, and
        where ranks share a device its message says so."""
        return self.placed(case, unsupported_reason(self.facts, case), self._run_on_ranks)

    def placed(self, case, reason: str | None, run_on, result_type: type[TPResult] = TPResult) -> TPResult:
        """``run_on(case, placement)``'s result on the ranks' placement, recorded in it (and said in its message where
        ranks share a device); not supported for ``reason`` without placing a rank."""
        if reason:
            return result_type(case.case_id, case, Outcome.NOT_SUPPORTED, reason, features=case.features())
        placement = self.placement(case.tp_size)
        result = run_on(case, placement)
        result.placement = placement.to_json()
        if placement.shared:
            result.message = f"{result.message} ({placement.label})" if result.message else placement.label
        return result

    def started_pool(self, case, placement: Placement, result_type: type[TPResult] = TPResult) -> RankPool | TPResult:
        """The pool of ``case``'s TP size on ``placement``, started; or, where it cannot start, the broken result that
        says why (said again, not retried, for every later case of that size)."""
        if case.tp_size in self._start_errors:
            failure = self._start_errors[case.tp_size]
            return result_type(case.case_id, case, Outcome.BROKEN, failure.message, features=case.features(), kinds=(failure.kind,),
                               traceback=failure.traceback, raised=failure.raised)
        pool = self._pool_for(case.tp_size, placement)
        starting = not pool.alive
        try:
            pool.start()
        except RankFailure as failure:
            failure.message = f"the tensor-parallel pool could not start: {failure.message}"
            self._start_errors[case.tp_size] = failure
            return result_type(case.case_id, case, Outcome.BROKEN, failure.message, features=case.features(), kinds=(failure.kind,),
                               failing_ranks=failure.ranks, traceback=failure.traceback, raised=failure.raised)
        self.pool_starts += starting
        return pool

    def _run_on_ranks(self, case: TPCase | MoETPCase, placement: Placement) -> TPResult:
        features = case.features()
        started = time.perf_counter()
        pool = self.started_pool(case, placement)
        if isinstance(pool, TPResult):
            return pool
        calls = []  # each call's answers, by rank: the case runs `runs` times on the same pool
        tensors = tensors_of(case)  # drawn here, the referee's process; every rank is handed them, and they judge
        try:
            for _ in range(self.runs):
                calls.append(pool.run(case, tensors, self.case_timeout))
        except RankFailure as failure:
            seconds = time.perf_counter() - started
            if failure.kind is None:
                return TPResult(case.case_id, case, Outcome.NOT_SUPPORTED, failure.message, features=features)
            which = f" (call {len(calls) + 1} of {self.runs}; the earlier returned)" if calls else ""
            return TPResult(case.case_id, case, Outcome.BROKEN, failure.message + which, features=features, seconds=seconds,
                            kinds=(failure.kind,), failing_ranks=failure.ranks, stability="flaky" if calls else None,
                            traceback=failure.traceback, raised=failure.raised)
        seconds = time.perf_counter() - started
        results = [self._judged(case, tensors, answers, features, seconds) for answers in calls]
        result = next((r for r in results if r.outcome is not Outcome.PASS), results[0])
        result.determinism = spread([answers[0].output for answers in calls])
        if len({(r.outcome, r.kinds) for r in results}) > 1:
            result.stability = "flaky"
            result.message += f" (flaky: {sum(r.outcome is Outcome.PASS for r in results)} of {len(results)} calls passed)"
        elif result.determinism is not None:
            result.stability = "deterministic" if result.determinism["identical"] else "nondeterministic"
        if result.outcome is Outcome.PASS and self.require_deterministic and result.stability == "nondeterministic":
            result.outcome, result.kinds = Outcome.FAIL, (FailureKind.NONDETERMINISTIC,)
            result.message = (f"{self.runs} calls on the same inputs differ in {result.determinism['differing_elements']} "
                              "element(s) of the gathered output (--require-deterministic)")
        return result

    @staticmethod
    def _judged(case: TPCase | MoETPCase, tensors, answers: list[RankAnswer], features, seconds: float) -> TPResult:
        """One call of the case: rank 0's gathered output judged here, every rank's writes into its inputs named."""
        output = answers[0].output
        groups = 1 if isinstance(case, MoETPCase) else case.replica_groups
        if output.dim() != 3 or output.size(0) != groups:  # the judge reads one output per replica group
            return TPResult(case.case_id, case, Outcome.FAIL, f"the gathered output has shape {tuple(output.shape)}; the layer "
                            f"gives {groups} output(s) of [tokens, width]", None, features, seconds, kinds=(FailureKind.WRONG_OUTPUT_TYPE,))
        modified = [(rank, text) for rank, answer in enumerate(answers) for text in answer.modified]
        input_bits = [(rank, entry) for rank, answer in enumerate(answers) for entry in answer.bit_level]
        verdict, message, slots, ranks, kinds, zeroed = judge_output(case, output, tensors)
        measurement = verdict.measurement
        if measurement is not None and input_bits:  # inputs with equal values and other bits: recorded, not failed
            measurement = replace(measurement, bit_differences=measurement.bit_differences + tuple(e for _, e in input_bits))
        if verdict.passed and not modified:  # a pass says what differs in bits only
            notes = [message] * bool(message) + [f"rank {rank}: {entry.note()}" for rank, entry in input_bits]
            return TPResult(case.case_id, case, Outcome.PASS, "; ".join(notes), measurement, features, seconds)
        if modified:
            details = [f"rank {rank}: {text}, which every wrapper method must only read" for rank, text in modified]
            message = "; ".join(([message] if message and not verdict.passed else []) + details)  # not a pass's notes
            kinds = ordered((*kinds, FailureKind.MODIFIED_INPUT))
            ranks = tuple(sorted({*ranks, *(rank for rank, _ in modified)}))
        return TPResult(case.case_id, case, Outcome.FAIL, message, measurement, features, seconds, slots,
                        kinds=kinds, outside_zeroed=zeroed, failing_ranks=ranks)

    def device_description(self) -> dict | None:
        return self._pool.device if self._pool is not None else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self.leftover_processes.extend(self._pool.leftover_processes)
            self._pool = None
