"""The target contract: what an implementation under test provides.

A target is a plain Python class (no pytest, no reports), so a vendor can also drive it from a script:

* ``name``, ``dtypes`` and ``device``: what it is, which dtypes it claims, where tensors must live;
* ``check_available()`` (classmethod): raise :class:`TargetUnavailable` naming the missing package or
  hardware; never fall back silently;
* ``unsupported_reason(case)``: ``None`` when the target claims the case, else the reason it does not
  (reported "not supported", never passed);
* ``update_metadata(mapping)``: take a :class:`conformance.reference.LoRAMapping` (slots, not ids);
* the ops, as methods with vLLM's names and argument order: the wrapper-level ones (LoRA bias as the
  optional keyword ``lora_bias_stacked``) and, optionally, the kernel-level ones. The registry
  ``conformance.ops.OP_SPECS`` is the list; ``python -m conformance.targets ops-table ops`` prints it
  (docs/targets.md embeds it, with every op's arguments);
* ``synchronize()``: wait for the device before outputs are read;
* ``call_context(op)``: the context manager the op level enters around each call of an op (and of
  ``update_metadata``) in the worker, for a framework that must be entered to run (an interop layer's
  environment, a device scope); default: none;
* ``device_traits()`` (classmethod): the visible-devices variable and ``torch.distributed`` backend of
  its device type (built in for cpu, cuda and hpu; a new device type states its own);
* optionally ``describe_device()``: ``{"device": …, "driver": …, "device_generation": …}`` for the
  environment fingerprint, where the suite has no reader for the device type (the generation is what a
  waiver's ``devices`` scope matches: docs/waivers.md);
* serving (the ``serving`` level, ``docs/serving.md``): ``start_serving(capacity)`` builds once what every
  later step writes into (a persistent wrapper sized to ``capacity``, a
  :class:`conformance.targets.capture.ServingCapacity`); ``capture(step)`` records one step and returns what
  replays it, or ``None`` when the target runs every step eagerly; ``serving_padding`` says what its
  ``update_metadata`` takes for a batch padded to a captured size (``"explicit"``: the mapping covers the
  padded rows, with no adapter, as vllm-gaudi's runner builds it; ``"real-rows"``: only the real tokens,
  the op then gets more rows than the mapping, as vLLM's GPU runner calls it);
* ``generation_engine``: how the end-to-end cases run on it: ``"decoder"`` (the suite's small decoder,
  every LoRA delta through the wrapper methods above) or ``"vllm"`` (the installed vLLM engine,
  ``LLM(enable_lora=True)``, on the target's device).

An op a target does not define is "not supported".
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, ClassVar

import torch

from conformance.ops import Level, ops_at
from conformance.targets.device_traits import DeviceTraits

if TYPE_CHECKING:
    from conformance.cases import Case
    from conformance.targets.capture import ServingCapacity, Step

# The built-in ops of each level, derived from the op specs (conformance.ops); code that must also see
# ops registered later asks conformance.ops.ops_at(level) instead.
KERNEL_OPS = ops_at(Level.KERNEL)
WRAPPER_OPS = ops_at(Level.WRAPPER)


class TargetUnavailable(RuntimeError):
    """The target cannot run here; the message says which package or hardware is missing."""


class TargetError(LookupError):
    """A target name or ``module:Class`` reference that does not resolve to a target."""


class Target:
    """Base class of every target. Subclasses define the ops they implement."""

    name: ClassVar[str] = "unnamed"
    description: ClassVar[str] = ""
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float16, torch.bfloat16, torch.float32})
    generation_engine: ClassVar[str] = "decoder"
    # Why an op is not implemented, where there is more to say than that (vLLM's CPU wrapper has no
    # MoE LoRA at all, say); the report shows it as the reason of every such case.
    why_not_implemented: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        self.check_available()
        self.device = self.default_device()

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`TargetUnavailable` with a one-line reason when the target cannot run here."""

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def device_traits(cls) -> DeviceTraits:
        """What the harness must know of this target's device type: the visible-devices variable
        ``--devices`` sets and the ``torch.distributed`` backend of its tensor-parallel ranks. The
        built-in device types (cpu, cuda, hpu) have theirs; a target on another device type overrides
        this, or its tensor-parallel cases are reported not supported and ``--devices`` asks for
        ``--device-env``."""
        return DeviceTraits.builtin(cls.default_device().type)

    def implemented_ops(self) -> tuple[str, ...]:
        """The registered ops this target defines (an op set to None is not defined)."""
        return tuple(op for op in ops_at(Level.KERNEL) + ops_at(Level.WRAPPER) if callable(getattr(self, op, None)))

    def not_implemented_reason(self, op: str) -> str:
        """Why ``op`` is not supported: the target's own words, or that it does not implement it."""
        return self.why_not_implemented.get(op, f"{self.name} does not implement {op}")

    def unsupported_reason(self, case: Case) -> str | None:
        """``None`` when the target claims ``case``; otherwise why it does not."""
        if case.op not in self.implemented_ops():
            return self.not_implemented_reason(case.op)
        if case.torch_dtype not in self.dtypes:
            return f"{self.name} does not support {case.dtype}"
        return None

    # What update_metadata takes for a batch padded to a captured size (see the module docstring).
    serving_padding: ClassVar[str] = "explicit"

    def start_serving(self, capacity: ServingCapacity) -> None:
        """Build, once, the state every later step of a serving sequence writes into (default: none: a target
        whose ``update_metadata`` keeps nothing across batches serves as it is)."""

    def capture(self, step: Step) -> Step | None:
        """Record ``step`` (which reads and writes only tensors that outlive it) and return what replays it;
        ``None``: this target runs every step eagerly (the report says so). ``conformance.targets.capture``
        has CUDA graphs, HPU graphs and the CPU emulation."""
        return None

    def synchronize(self) -> None:
        """Wait until queued device work is done (no-op on the CPU)."""

    def call_context(self, op: str) -> AbstractContextManager:
        """The context the worker enters around each call of ``op`` (a suite op's name, or ``"update_metadata"``),
        the ``synchronize()`` after it included; entered afresh per call (``conformance.target_call.execute``).
        Override to enter your framework's context (``torchax.default_env()``, a device scope) there instead of
        in every op. Default: a null context."""
        return nullcontext()
