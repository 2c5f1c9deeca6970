"""The target's half of an op case: call it as vLLM would, and hand back everything it was given.

This is all of a case that runs in the target's process (``conformance.isolation``); the referee
(``conformance.referee``) draws the values before and judges what comes back after, in a process that
never imports the target. So nothing here decides an outcome: :func:`call_target` only reports what
happened, as plain data (:class:`TargetCall`, CPU tensors) that crosses a pipe as a frame of the wire
(:func:`serve`, the op level's target half); the referee reads it back with :func:`answer`, which
refuses anything but a well-formed answer to its own request.

What the target gets, per attempt at a case:

* a wrapper op: one ``update_metadata(mapping)``, then the method ``runs`` times on that one state,
  each time on fresh copies of the inputs: vLLM updates the metadata once per step and calls the
  wrapper once per LoRA layer, so a wrapper that loses its batch state after one call shows here;
* a kernel op: the kernel ``runs`` times, each on fresh copies of its inputs and of its metadata.

Every tensor handed over comes back after each call (:func:`handed_tensors`): the op's values (its
inputs and outputs) and the metadata built for the call (``lora_indices_tensor``, ``seq_len_tensor``,
``token_lora_mapping``, ``lora_ids``, …), named by the parameter of the op's reference signature, so
the referee can say which one a target wrote into.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from conformance.cases.case import Case
from conformance.ops import OP_SPECS, Level, OpCall, OpSpec, case_mapping
from conformance.text import describe_exception, format_traceback, raised_at
from conformance.wire import Limits, WireError, from_data, to_data

Tensors = dict[str, torch.Tensor]

DEFAULT_RUNS = 2  # calls per attempt: the determinism check compares them bit for bit (--repeat)


@dataclass
class TargetCall:
    """What one attempt at a case gave: ``status`` ``"ran"``, ``"raised"`` or ``"not_supported"``.

    ``runs`` holds, for each call that returned, every tensor handed to the target as it was after
    that call, on the CPU; ``raised_in`` the call (0-based) that raised, if one did, and ``traceback``
    what it raised, formatted here in the target's process (``conformance.text.format_traceback``): from
    :func:`call_target` through :func:`execute` into the target's frames, with the chained causes; ``raised``
    the exception's type and the innermost frame of the target's code, as data (``conformance.text.raised_at``).
    """

    status: Literal["ran", "raised", "not_supported"]
    message: str = ""
    runs: list[Tensors] = field(default_factory=list)
    seconds: float = 0.0
    raised_in: int | None = None
    traceback: str | None = None
    raised: dict[str, str] | None = None


def _parameter_names(spec: OpSpec) -> tuple[str, ...]:
    return _reference_parameters(spec.reference, spec.level == Level.WRAPPER)


@functools.cache
def _reference_parameters(reference, is_method: bool) -> tuple[str, ...]:
    """The positional parameters of an op's reference (read once: ``inspect.signature`` costs a case 0.1 ms)."""
    parameters = list(inspect.signature(reference).parameters.values())
    if is_method:
        parameters = parameters[1:]  # a method of PunicaWrapperReference: its self
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def call_tensors(spec: OpSpec, call: OpCall) -> dict[str, torch.Tensor]:
    """Every tensor in ``call``, named by the parameter it is passed as (``lora_a_stacked[1]`` for the
    second of a tuple); positional arguments past the reference's signature as ``argument N``."""
    names = _parameter_names(spec)
    arguments = [(names[i] if i < len(names) else f"argument {i}", value) for i, value in enumerate(call.args)]
    arguments += list(call.kwargs.items())
    found: dict[str, torch.Tensor] = {}
    for name, value in arguments:
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, (tuple, list)):
            found.update((f"{name}[{i}]", item) for i, item in enumerate(value) if isinstance(item, torch.Tensor))
    return found


def prepare(spec: OpSpec, case: Case, values: Tensors, device: torch.device, *, copy: bool = True,
            outputs_only: bool = False) -> tuple[Tensors, OpCall]:
    """Fresh copies of ``values`` on ``device`` (``values`` themselves with ``copy=False``, for a call that
    is never made; fresh copies of the outputs only with ``outputs_only``, for the golden reference, which reads
    its inputs and nothing else), the call made of them, and every tensor the call hands over: the values by
    their own names, the metadata the call built by parameter name."""
    if not copy:
        tensors = dict(values)
    elif outputs_only:
        tensors = {name: value.to(device).clone() if name in spec.outputs else value.to(device) for name, value in values.items()}
    else:
        tensors = {name: value.to(device).clone() for name, value in values.items()}
    call = spec.make_call(case, tensors, device)
    handed = dict(tensors)
    storages = {tensor.untyped_storage().data_ptr() for tensor in tensors.values()}
    for name, tensor in call_tensors(spec, call).items():
        if tensor.untyped_storage().data_ptr() not in storages:  # not a view of a value: metadata
            handed[name if name not in handed else f"{name} (metadata)"] = tensor
    return handed, call


def handed_tensors(spec: OpSpec, case: Case, values: Tensors) -> Tensors:
    """What a correct target hands back, on the CPU: the values as drawn and the metadata as built (nothing
    is called on them, so the values themselves serve)."""
    return prepare(spec, case, values, torch.device("cpu"), copy=False)[0]


def execute(spec: OpSpec, case: Case, values: Tensors, impl, device: torch.device, *, update_metadata: bool = True,
            outputs_only: bool = False) -> Tensors:
    """Run ``spec`` once on copies of ``values`` moved to ``device``; every handed tensor afterwards, on the CPU.

    ``update_metadata=False`` reuses the mapping ``impl`` was given by an earlier ``execute`` of the
    same case (the reference's oracle and baseline runs share one). ``outputs_only``: copy the outputs only (the
    referee's own runs of the golden reference, which never writes its inputs: a target always gets copies).
    """
    if spec.level == Level.WRAPPER and update_metadata:
        give_metadata(impl, case)
    handed, call = prepare(spec, case, values, device, outputs_only=outputs_only)
    with impl.call_context(spec.name):  # the target's framework entered around the call and its wait (Target.call_context)
        getattr(impl, spec.name)(*call.args, **call.kwargs)
        impl.synchronize()
    return {name: tensor.cpu() for name, tensor in handed.items()}


def give_metadata(impl, case: Case) -> None:
    """``impl.update_metadata`` of the case's mapping, inside ``impl.call_context("update_metadata")``."""
    with impl.call_context("update_metadata"):
        impl.update_metadata(case_mapping(case))


def call_target(target, case: Case, values: Tensors, runs: int = DEFAULT_RUNS) -> TargetCall:
    """One attempt at ``case`` on ``target``: see the module docstring. Never raises for the target."""
    if case.op not in target.implemented_ops():
        return TargetCall("not_supported", target.not_implemented_reason(case.op))
    reason = target.unsupported_reason(case)
    if reason is not None:
        return TargetCall("not_supported", reason)
    spec = OP_SPECS[case.op]
    outcome = TargetCall("ran")
    started = time.perf_counter()
    try:
        outcome.raised_in = 0  # a raise in update_metadata is the first call's (else the answer is refused as malformed)
        if spec.level == Level.WRAPPER:
            give_metadata(target, case)  # once: every call below runs on this state
        for run in range(runs):
            outcome.raised_in = run
            outcome.runs.append(execute(spec, case, values, target, target.device, update_metadata=False))
        outcome.raised_in = None
    except NotImplementedError as exc:
        return TargetCall("not_supported", f"{case.op} raised {describe_exception(exc)}")
    except Exception as exc:  # noqa: BLE001 - whatever the target raises is the referee's to judge
        outcome.status, outcome.message = "raised", describe_exception(exc)
        outcome.traceback = format_traceback(exc)  # here: the frames do not cross the pipe, their text does
        outcome.raised = raised_at(exc, target)
    outcome.seconds = time.perf_counter() - started
    return outcome


# -- across the pipe -------------------------------------------------------------------------------


def serve(executor, request: dict) -> dict:
    """The op level's target half, in the target's process: ``{"case", "values", "runs"}`` → the
    :class:`TargetCall` of one attempt, as data (``conformance.isolation.local.LocalExecutor.call``)."""
    return to_data(call_target(executor.target, Case.from_json(request["case"]), request["values"], request["runs"]))


def request(case: Case, values: Tensors, runs: int) -> dict:
    """What the referee sends for one attempt at ``case`` (its values as drawn: the target's half copies them per call)."""
    return {"case": case.to_json(), "values": values, "runs": runs}


REPLY_SLACK = 1 << 20  # bytes beyond twice the handed tensors an answer may declare (a few resized scalars)


def reply_limits(expected: Tensors, runs: int) -> Limits:
    """What an answer to a request for ``runs`` calls may carry: every handed tensor back after each call, each at
    most twice its size (a target that grows a tensor is judged for it; one that declares more is refused unread)."""
    size = sum(tensor.numel() * tensor.element_size() for tensor in expected.values())
    return Limits(tensor_bytes=runs * 2 * size + REPLY_SLACK, tensors=runs * len(expected))


def answer(data, expected: Tensors, runs: int) -> TargetCall:
    """The referee's reading of an answer: a :class:`TargetCall` of the declared types, with ``runs`` calls when it
    ran, fewer when one raised, none otherwise, each naming only tensors the referee handed over. ``WireError``
    naming what is wrong otherwise: the case is then broken (``malformed reply``), nothing of it judged."""
    call = from_data(TargetCall, data, "the op's answer")
    if call.status == "ran" and len(call.runs) != runs:
        raise WireError(f"the op's answer ran {len(call.runs)} call(s), not the {runs} asked for")
    if call.status == "raised" and (call.raised_in != len(call.runs) or len(call.runs) >= runs):
        raise WireError(f"the op's answer raised in call {call.raised_in} after {len(call.runs)} call(s) of {runs}")
    if call.status == "not_supported" and call.runs:
        raise WireError("the op's answer is 'not supported' yet holds calls")
    for index, run in enumerate(call.runs):
        unknown = sorted(set(run) - set(expected))
        if unknown:
            raise WireError(f"call {index + 1} hands back tensors the referee never handed over: {[n[:40] for n in unknown[:8]]}")
    if call.seconds < 0:
        raise WireError(f"the op's answer took {call.seconds} s")
    return call
