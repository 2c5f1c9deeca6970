"""The target's half of a serving case: drive one target instance step after step, as vLLM's model runner does.

Runs in the target's process (the worker). Nothing here judges: it hands back, after every step, every
persistent buffer as it is then, and each step's batch called fresh (one op call on fresh tensors, as an
op case calls it), as data. Per case:

1. a new instance of the target (the worker's own instance keeps serving op cases as they expect), and
   ``start_serving(capacity)`` once;
2. the persistent buffers, made once at their largest size: the rows (activations, output, routing) from
   the referee's first contents, the stacks and per-slot flags zeroed;
3. per step: the resident adapters copied into the stacks in place, the batch into the first rows of
   the row buffers, ``update_metadata`` with the step's mapping, then the layer on the step's rows,
   views of the persistent buffers: captured (``capture``), replayed (the graph captured for the step's
   key), or eager. A capture step is recorded, its batch written again (recording may run it), then
   replayed once;
4. each step's batch again on the worker's own target, fresh and unpadded, so the referee can tell a
   serving bug (fails served, passes fresh) from a wrong op (fails both).

What ``update_metadata`` gets for a padded batch is the target's ``serving_padding``: ``"explicit"``: the
mapping covers the padded rows as sequences of one token with no adapter (vllm-gaudi's runner);
``"real-rows"``: only the real tokens, and the layer gets more rows than the mapping (vLLM's GPU runner).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from conformance.cases.case import Case
from conformance.ops import OP_SPECS, case_mapping
from conformance.target_call import execute
from conformance.targets import load
from conformance.targets.capture import ServingCapacity
from conformance.text import describe_exception, format_traceback, raised_at
from conformance.wire import to_data

from .case import ServingCase
from .values import padded_rows

Tensors = dict[str, torch.Tensor]
PADDINGS = ("explicit", "real-rows")


@dataclass
class ServedRun:
    """What a serving case gave: ``status`` ``"ran"``, ``"raised"`` or ``"not_supported"``.

    ``steps``: after each served step, every persistent buffer (CPU copies); ``fresh``: after each step's batch
    called fresh, every tensor handed over (as ``conformance.target_call.execute`` returns them); ``raised_in``:
    the step that raised (``len(case.steps) + k`` for the fresh call of step ``k``); ``graphs``: how the target ran
    its steps, in words; ``rows``: the rows the layer got at each step (the step's captured size, or its real tokens where
    a ``"real-rows"`` target ran it without a graph, unpadded, as vLLM's runner runs a batch it dispatches to no graph)."""

    status: Literal["ran", "raised", "not_supported"]
    message: str = ""
    graphs: str = ""
    steps: list[Tensors] = field(default_factory=list)
    fresh: list[Tensors] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    raised_in: int | None = None
    traceback: str | None = None
    raised: dict[str, str] | None = None
    seconds: float = 0.0


def padded_case(case, rows: int):
    """``case`` (an op case, or a tensor-parallel one) with ``rows − tokens`` more sequences of one token and no
    adapter: the padded batch's shape (an MoE op case's padded tokens routed to expert 0)."""
    extra = rows - case.num_tokens
    if extra <= 0:
        return case
    routing = {"topk_ids": case.topk_ids + ((0,) * case.top_k,) * extra if case.top_k else ()} if isinstance(case, Case) else {}
    return dataclasses.replace(case, seq_lens=case.seq_lens + (1,) * extra, seq_slots=case.seq_slots + (-1,) * extra, **routing)


def capacity_of(case) -> ServingCapacity:
    """What a server of ``case`` (a ``ServingCase`` or a ``TPServingCase``) is built for."""
    sizes = tuple(sorted({size for size, _ in case.graphs}))
    counts = tuple(sorted({count for _, count in case.graphs}))
    return ServingCapacity(case.max_tokens, case.max_tokens, case.layer.num_slots, case.layer.max_rank, sizes, counts)


def unsupported(target, case: ServingCase) -> str | None:
    """Why ``target`` does not serve ``case``: the op, the dtype or a step's batch it refuses as an op case."""
    if case.op not in target.implemented_ops():
        return target.not_implemented_reason(case.op)
    padding = getattr(target, "serving_padding", "explicit")
    if padding not in PADDINGS:
        return f"{target.name}.serving_padding is {padding!r}, not one of {PADDINGS}"
    for index in range(len(case.steps)):
        reason = target.unsupported_reason(case.step_case(index))
        if reason is not None:
            return reason
    return None


class Server:
    """One target instance and its persistent buffers, driven step by step."""

    def __init__(self, target, case: ServingCase, initial: Tensors, first: Tensors) -> None:
        self.target, self.case, self.spec = target, case, OP_SPECS[case.op]
        device = target.device
        self.rows = {name: tensor.to(device).clone() for name, tensor in initial.items()}
        self.slots = {name: torch.zeros_like(first[name], device=device) for name in first if name not in self.rows}
        self.graphs: dict[int, object] = {}
        self.given: list[int] = []  # the rows the layer got, step by step
        self.captured = 0

    def write_batch(self, values: Tensors) -> None:
        for name, tensor in values.items():
            if name in self.rows:
                self.rows[name][: tensor.size(0)].copy_(tensor)

    def run(self, index: int, values: Tensors) -> Tensors:
        step, case = self.case.steps[index], self.case.step_case(index)
        for name, buffer in self.slots.items():  # adapters loaded (and per-slot flags set) in place
            buffer.copy_(values[name])
        self.write_batch(values)
        explicit = getattr(self.target, "serving_padding", "explicit") == "explicit"
        # vLLM's runner pads a batch only to replay a graph; vllm-gaudi's pads every batch to its bucket
        rows = step.rows if explicit or step.mode == "capture" or self.graphs.get(step.graph) is not None else step.num_tokens
        self.given.append(rows)
        padded = padded_case(case, rows)
        self.target.update_metadata(case_mapping(padded if explicit else case))
        views = {name: buffer[: padded_rows(values, name, step.num_tokens, rows)] for name, buffer in self.rows.items()} | self.slots
        call = self.spec.make_call(padded, views, self.target.device)
        method = getattr(self.target, self.case.op)

        def layer() -> None:
            method(*call.args, **call.kwargs)

        if step.mode == "capture":
            graph = self.target.capture(layer)
            self.graphs[step.graph] = graph
            self.captured += graph is not None
            self.write_batch(values)  # recording may have run the layer on it
            (graph or layer)()
        elif step.mode == "replay":
            (self.graphs.get(step.graph) or layer)()
        else:
            layer()
        self.target.synchronize()
        return {name: buffer.cpu().clone() for name, buffer in (self.rows | self.slots).items()}

    def described(self) -> str:
        if not any(step.mode == "capture" for step in self.case.steps):
            return "eager (every step of this layer runs outside a captured graph)"
        if self.captured:
            return f"{self.captured} graph(s) captured with {type(self.target).__name__}.capture, replayed on persistent buffers"
        return f"eager: {self.target.name} captures nothing (capture returned None); every step ran eagerly on persistent buffers"


def drive(target_name: str, shared, case: ServingCase, initial: Tensors, steps: list[Tensors]) -> ServedRun:
    """Serve every step on a new instance of the target, then call each step's batch fresh on ``shared``."""
    reason = unsupported(shared, case)
    if reason is not None:
        return ServedRun("not_supported", reason)
    run = ServedRun("ran")
    started = time.perf_counter()
    target = None
    try:
        run.raised_in = 0
        target = load(target_name)
        target.start_serving(capacity_of(case))
        server = Server(target, case, initial, steps[0])
        for index, values in enumerate(steps):
            run.raised_in = index
            run.steps.append(server.run(index, values))
        run.graphs, run.rows = server.described(), server.given
        spec = OP_SPECS[case.op]
        for index, values in enumerate(steps):
            run.raised_in = len(steps) + index
            run.fresh.append(execute(spec, case.step_case(index), values, shared, shared.device))
        run.raised_in = None
    except NotImplementedError as exc:
        return ServedRun("not_supported", f"serving {case.op} raised {describe_exception(exc)}")
    except Exception as exc:  # noqa: BLE001 - whatever the target raises is the referee's to judge
        run.status, run.message = "raised", describe_exception(exc)
        run.traceback, run.raised = format_traceback(exc), raised_at(exc, target or shared)
    run.seconds = time.perf_counter() - started
    return run


def serve(executor, request: dict) -> dict:
    """The serving level's target half: ``{"case", "initial", "steps"}`` → the :class:`ServedRun`, as data."""
    case = ServingCase.from_json(request["case"])
    return to_data(drive(executor.target_name, executor.target, case, request["initial"], request["steps"]))


__all__ = ["PADDINGS", "ServedRun", "drive", "padded_case", "serve"]
