"""Judge an installed vLLM ``PunicaWrapper`` subclass as it is: :class:`VllmPunicaWrapperTarget`.

A platform already in vLLM brings up LoRA by judging its own subclass of vLLM's
``vllm.lora.punica_wrapper.punica_base.PunicaWrapperBase`` (``PunicaWrapperCPU``, ``PunicaWrapperGPU``,
vllm-gaudi's ``PunicaWrapperHPU``, a vendor's own). A target subclasses :class:`VllmPunicaWrapperTarget`
and sets ``wrapper_class`` (the class, or ``"package.module:Class"``, imported in ``check_available``),
``name``, ``dtypes`` and ``default_device()``; optionally ``kernel_ops``, to judge the kernels the
wrapper calls too. This base then does what vLLM's ``LoRAModelManager`` does around its wrapper:

* **construction**: one wrapper per batch (:meth:`VllmPunicaWrapperTarget.construct_wrapper`, the one
  method to override), as ``get_punica_wrapper(max_num_batched_tokens, max_batches, device,
  lora_config=…)`` builds it; ``lora_config`` only where the constructor takes it;
* **metadata**: vLLM's wrappers take adapter *ids* (0 = none) and a slot table ``lora_index_to_id``;
  the suite speaks slots. Slot ``l`` gets id ``l + 1``, so ``lora_index_to_id = [1, 2, …, L]`` and
  −1 ↔ id 0; ``max_loras`` is ``L + 1``, as the model manager passes ``lora_slots + 1``;
* **forwarding**: each suite wrapper op of the same name as a vLLM wrapper method (``add_shrink``,
  ``add_expand``, ``add_lora_linear``, ``add_lora_embedding``, ``add_lora_logits``,
  ``apply_lora_full_linear``; ``add_lora_w13``/``add_lora_w2`` through :mod:`.vllm_cuda_moe`, which
  expresses the neutral MoE contract in vLLM's signatures) is forwarded by argument *name*, so the
  signature variants of vLLM releases and plugins (LoRA bias positional or keyword) need no code.
  ``token_classification_head`` is computed over the wrapper's ``add_shrink``, as vLLM 0.33's layer does, and
  vLLM 0.34's layer ops (``conformance.targets.vllm034_layers``) over its ``add_lora_linear`` /
  ``add_lora_embedding`` where the installed vLLM is 0.34 or later (an older one lacks the layer: not supported).
  A method the wrapper class lacks, leaves abstract, or whose body only raises ``NotImplementedError``
  (what ``PunicaWrapperBase`` gives every LoRA method it declares) is *not implemented*: the op is
  ``None``, with a reason naming the class, before any case runs;
* **LoRA bias** (``lora_bias_stacked``) goes only to methods whose installed signature names it; bias
  cases of the others are declared not supported;
* **return values**: ``can_update_inplace`` is the answer of the wrapper's platform to vLLM's
  ``Platform.can_update_inplace()`` (``vllm/platforms/interface.py``; ``True`` unless a platform says
  otherwise). ``True``: vLLM's layers read the output argument ``y`` as the method left it and drop what
  it returns, and so does the suite. ``False``: the layers take what ``add_shrink``, ``add_expand``,
  ``add_lora_linear``, ``add_lora_embedding`` and ``add_lora_logits`` return as the new ``y``
  (:data:`RESULT_METHODS`); the suite then checks the returned tensor has ``y``'s shape and dtype
  (:class:`WrapperResultError` naming the method otherwise: the case is broken) and copies it into
  ``y``, whether or not the method also wrote ``y``, so every caller (the op, layer and model levels) sees
  the result vLLM's layers would use;
* **versions**: ``package_versions`` states the vLLM the wrapper runs on (``TargetFacts``), against which
  the expectations' ``versions`` ranges are evaluated.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any, ClassVar

import torch

from conformance.ops import Level, ops_at
from conformance.reference import LoRAMapping

from . import vllm_cuda_moe as moe
from ._vllm import import_vllm_module, vllm_version
from .base import Target, TargetUnavailable
from .classification_head import TokenHeadFromShrink
from .kernel_adapter import KernelAdapter
from .vllm034_layers import VLLM_034_LAYERS, Vllm034Layers

# The wrapper methods whose return value vLLM 0.32's LoRA layers take as the new output when the platform cannot
# update in place (``if not current_platform.can_update_inplace(): output = lora_output`` in
# vllm/lora/layers/base_linear.py, column_parallel_linear.py, row_parallel_linear.py, vocab_parallel_embedding.py,
# logits_processor.py, classifier.py). apply_lora_full_linear's return is dropped there either way (classifier.py),
# and add_lora_w13's is MoE metadata, not an output (model_executor/layers/fused_moe/experts/lora_experts_mixin.py).
RESULT_METHODS = frozenset({"add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding", "add_lora_logits"})


class WrapperResultError(TypeError):
    """A wrapper method of a target that cannot update in place returned something other than the new ``y``."""


def take_result(target: str, method: str, returned: Any, y) -> None:
    """Copy ``returned``, the new value of ``y`` a wrapper method of a platform that cannot update in place gave
    back, into ``y``; :class:`WrapperResultError` saying what is wrong when it is not a tensor of ``y``'s shape
    and dtype (``copy_`` would broadcast or cast it silently)."""
    if not isinstance(returned, torch.Tensor):
        got = "None" if returned is None else f"a {type(returned).__module__}.{type(returned).__qualname__}"
        raise WrapperResultError(
            f"{target}: {method} returned {got}, not the new y; a target with can_update_inplace = False must return "
            "the new value of y from every method vLLM's layers take a result of (set can_update_inplace = True if "
            "your platform's layers read y as the method wrote it)"
        )
    if returned.shape != y.shape or returned.dtype != y.dtype:
        raise WrapperResultError(
            f"{target}: {method} returned a tensor of shape {tuple(returned.shape)} and dtype {returned.dtype}; "
            f"expected y's shape {tuple(y.shape)} and dtype {y.dtype} (return the whole new y, in its dtype)"
        )
    if returned is not y:
        y.copy_(returned)


# -- speaking vLLM's mapping ------------------------------------------------------------------------


def vllm_lora_mapping(mapping: LoRAMapping):
    """vLLM's ``LoRAMapping`` (ids, not slots) for the suite's slot mapping."""
    layers = import_vllm_module("vllm.lora.layers", "vllm")
    return layers.LoRAMapping(
        index_mapping=tuple(slot + 1 for slot in mapping.token_slots),
        prompt_mapping=tuple(slot + 1 for slot in mapping.sampled_slots),
        is_prefill=mapping.is_prefill,
    )


def lora_index_to_id(num_slots: int) -> list[int | None]:
    return list(range(1, num_slots + 1))


def needs_lora_bias(case) -> bool:
    """The case passes ``lora_bias_stacked``. A full-linear head's bias is an argument of its own
    (``apply_lora_full_linear``'s ``bias_stacked``, always there), not LoRA bias."""
    return case.bias and case.op != "apply_lora_full_linear"


def accepts_keyword(function, name: str) -> bool:
    return name in inspect.signature(function).parameters


def update_metadata_kwargs(update_metadata: Callable) -> dict[str, Any]:
    """Keyword arguments beyond (mapping, lora_index_to_id, max_loras) for the installed signature.

    ``vocab_size``/``extra_vocab_size`` only feed ``embeddings_indices`` (and long-LoRA offsets in old
    releases), which no op under test reads.
    """
    params = inspect.signature(update_metadata).parameters
    kwargs: dict[str, Any] = {}
    if "vocab_size" in params:
        kwargs["vocab_size"] = 1
    if "extra_vocab_size" in params:
        kwargs["extra_vocab_size"] = 0
    return kwargs


def allowed_lora_rank(config_class: type, at_least: int | None = None) -> int | None:
    """A ``max_lora_rank`` the installed ``LoRAConfig`` accepts: the smallest allowed value ≥ ``at_least``,
    or the largest allowed one (``None`` when the field is not a ``Literal``: then any int goes)."""
    try:
        hint = typing.get_type_hints(config_class).get("max_lora_rank")
    except Exception:  # noqa: BLE001 - unresolvable annotations: let LoRAConfig pick its default
        return None
    allowed = sorted(a for a in typing.get_args(hint) if isinstance(a, int))
    if not allowed:
        return None
    if at_least is not None:
        for rank in allowed:
            if rank >= at_least:
                return rank
    return allowed[-1]


def make_lora_config(config_class: type, max_loras: int, specialize_active_lora: bool = False):
    """vLLM's ``LoRAConfig`` for a wrapper of ``max_loras`` slots, through its own validation.

    ``PunicaWrapperGPU`` (0.32) reads only ``max_loras`` and ``specialize_active_lora`` (False: vLLM's
    default). ``max_lora_rank`` is validated against a fixed list (``Literal[1, 8, …, 512]``) but never
    read by the wrapper (kernels take the rank from the weights), and ``update_metadata`` does not see
    the case's rank; so it gets the largest allowed value, under which no case rank would be rejected
    should a later wrapper read it. Only fields the installed ``LoRAConfig`` has are passed.
    """
    wanted: dict[str, Any] = {"max_loras": max_loras, "specialize_active_lora": specialize_active_lora}
    rank = allowed_lora_rank(config_class)
    if rank is not None:
        wanted["max_lora_rank"] = rank
    known = {f.name for f in fields(config_class)} if is_dataclass(config_class) else set(wanted)
    return config_class(**{k: v for k, v in wanted.items() if k in known})


@functools.cache
def _default_lora_config(max_loras: int):
    """The ``LoRAConfig`` the base hands a wrapper that takes one (``None`` where the installed vLLM has none)."""
    for module_name in ("vllm.config.lora", "vllm.config"):
        try:
            config_class = getattr(importlib.import_module(module_name), "LoRAConfig", None)
        except ImportError:
            continue
        if config_class is not None:
            return make_lora_config(config_class, max_loras)
    return None


def takes_keyword(function, name: str) -> bool:
    """Whether ``function`` can be given ``name=…``: it names it, or takes ``**kwargs``."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


# -- resolving a dotted "package.module:Class" --------------------------------------------------------


def resolve_dotted(reference: str, target: str, what: str, package: str | None = None) -> Any:
    """The object ``"package.module:attribute"`` names, imported now; :class:`TargetUnavailable` saying
    why not (a malformed reference, the import error and the package to install, a missing attribute)."""
    module_name, colon, attribute = reference.partition(":")
    if not colon or not module_name or not attribute or " " in reference:
        raise TargetUnavailable(
            f"target {target!r}: {what} {reference!r} is not a 'package.module:Class' reference "
            "(the module's dotted import path, a colon, the class's name)"
        )
    install = f"pip install {package}" if package else f"install the distribution that provides {module_name.split('.')[0]!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        one_line = " ".join(str(exc).split())
        raise TargetUnavailable(
            f"target {target!r}: {what} {reference!r} does not import ({type(exc).__name__}: {one_line}); {install}"
        ) from exc
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise TargetUnavailable(
                f"target {target!r}: {what} {reference!r}: module {module_name} has no {attribute} "
                f"(is the installed {module_name.split('.')[0]} the release that defines it?)"
            )
        found = getattr(found, part)
    return found


# -- which wrapper methods a class implements -----------------------------------------------------------


@functools.lru_cache(maxsize=1024)  # asked on every read of a forwarded op: parse each function once
def _only_raises_not_implemented(function) -> bool:
    """Whether ``function``'s body (its docstring aside) is a single ``raise NotImplementedError``,
    as ``PunicaWrapperBase`` writes every LoRA method it declares. Unreadable source: it is code."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    raised = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def missing_method_reason(wrapper_class: type, method: str) -> str | None:
    """Why ``wrapper_class`` does not implement ``method`` (missing, abstract, or only raising
    ``NotImplementedError``), naming the class that left it so; ``None`` when it implements it."""
    function = getattr(wrapper_class, method, None)
    name = wrapper_class.__qualname__
    if function is None:
        return f"{name} (vLLM {vllm_version()}) has no {method}"
    owner = next((klass for klass in wrapper_class.__mro__ if method in vars(klass)), wrapper_class)
    defined = f"{name}.{method}" if owner is wrapper_class else f"{name} inherits {owner.__qualname__}.{method}, which"
    if getattr(function, "__isabstractmethod__", False):
        return f"{name}.{method} is abstract: {name} does not implement it"
    if _only_raises_not_implemented(inspect.unwrap(function)):
        return f"{name} does not implement {method}: {defined} only raises NotImplementedError"
    return None


class WrapperMethod:
    """A suite op forwarded to a wrapper method: the forwarding function where the wrapper class
    implements every vLLM method it needs, else ``None`` (so the op is "not implemented").

    Read on the class (the facts, ``describe``) and on an instance alike. Until ``wrapper_class`` is a
    class (unset, or a dotted name ``check_available`` has not imported yet) the target's own word
    decides: an op it names in ``why_not_implemented`` is ``None``, every other one forwarded.
    """

    def __init__(self, forward: Callable, needs: tuple[str, ...] = ()) -> None:
        self.forward = forward
        self.needs = needs
        functools.update_wrapper(self, forward)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.needs = self.needs or (name,)

    def missing(self, holder) -> str | None:
        """Why ``holder`` (a target or its class) cannot forward this op, or ``None``."""
        wrapper_class = getattr(holder, "wrapper_class", None)
        if not isinstance(wrapper_class, type):
            return holder.why_not_implemented.get(self.name)
        for method in self.needs:
            if (reason := missing_method_reason(wrapper_class, method)) is not None:
                return reason
        return None

    def __call__(self, target, *args, **kwargs):  # as the plain function it stands for, read from vars()
        return self.forward(target, *args, **kwargs)

    def __get__(self, target, owner=None):
        if self.missing(target if target is not None else owner) is not None:
            return None
        return self.forward if target is None else types.MethodType(self.forward, target)


def vllm_release() -> tuple[int, ...]:
    """The installed vLLM's release numbers (``0.32.0+cpu`` → ``(0, 32, 0)``); ``()`` when unknown."""
    numbers = []
    for part in vllm_version().split("+")[0].split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


class Vllm034LayerMethod(WrapperMethod):
    """A vLLM 0.34 layer's code over the wrapper's methods (``conformance.targets.vllm034_layers``): there where
    the installed vLLM has that layer (0.34 or later) and its wrapper implements the methods the layer calls."""

    def missing(self, holder) -> str | None:
        if isinstance(getattr(holder, "wrapper_class", None), type) and vllm_release() < (0, 34):
            return f"the installed vLLM {vllm_version()} predates {VLLM_034_LAYERS[self.name]}, added in vLLM 0.34"
        return super().missing(holder)


def forwarded(*needs: str) -> Callable[[Callable], WrapperMethod]:
    """Decorate a forwarding function: the op exists where the wrapper class implements ``needs``
    (by default the method of the op's own name)."""
    return lambda forward: WrapperMethod(forward, needs)


# Said by a target whose wrapper class may predate apply_lora_full_linear (it is None there).
FULL_LINEAR_MISSING = (
    "the installed vLLM's wrapper has no apply_lora_full_linear (the classification heads' full linear, added in vLLM 0.32)"
)


# -- the target -----------------------------------------------------------------------------------


class VllmPunicaWrapperTarget(TokenHeadFromShrink, Target):
    """A target that judges a vLLM ``PunicaWrapper`` subclass (see the module docstring).

    Set ``wrapper_class`` (a class, or ``"package.module:Class"``: then ``wrapper_package``, the pip
    requirement that provides it, is named when it does not import), ``name``, ``dtypes`` and
    ``default_device()``. ``kernel_ops`` maps kernel op names (``bgmv_shrink``, …) to the callables the
    wrapper calls (or ``"module:function"``), judged as kernel ops too: in vLLM's signature, or of another
    one through a declared ``adapt(...)`` (``conformance.targets.kernel_adapter``). Override
    :meth:`construct_wrapper` where the wrapper needs more than vLLM's constructor arguments.
    """

    description = "an installed vLLM PunicaWrapper subclass"
    wrapper_class: ClassVar[type | str | None] = None
    wrapper_package: ClassVar[str | None] = None
    kernel_ops: ClassVar[Mapping[str, Callable | str]] = {}
    # The vLLM the wrapper runs on, stated by check_available (TargetFacts.package_versions).
    package_versions: ClassVar[dict[str, str]] = {}
    # vLLM's Platform.can_update_inplace() of the platform the wrapper runs on: False when its layers use what the
    # wrapper methods return instead of their y (the module docstring says what the suite does with each answer).
    can_update_inplace: ClassVar[bool] = True
    # What the subclass itself says (why_not_implemented as declared); check_available adds the wrapper's gaps.
    _declared_why_not: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "why_not_implemented" in vars(cls):
            cls._declared_why_not = dict(cls.why_not_implemented)

    @classmethod
    def check_available(cls) -> None:
        """Import ``wrapper_class`` (and ``kernel_ops``) where given by name, state the vLLM version, and
        list what the wrapper class leaves unimplemented in ``why_not_implemented``."""
        if cls.wrapper_class is None:
            raise TargetUnavailable(
                f"target {cls.name!r} ({cls.__qualname__}) sets no wrapper_class: set it to the vLLM PunicaWrapper "
                "subclass to judge, or to its 'package.module:Class'"
            )
        if isinstance(cls.wrapper_class, str):
            cls.wrapper_class = resolve_dotted(cls.wrapper_class, cls.name, "wrapper_class", cls.wrapper_package)
        if not isinstance(cls.wrapper_class, type):
            raise TargetUnavailable(f"target {cls.name!r}: wrapper_class is {cls.wrapper_class!r}, not a class")
        cls.kernel_ops = cls._resolved_kernel_ops()
        cls.package_versions = cls.stated_versions()
        gaps = {}
        for op in ops_at(Level.WRAPPER):
            method = inspect.getattr_static(cls, op, None)
            if isinstance(method, WrapperMethod) and (reason := method.missing(cls)) is not None:
                gaps[op] = reason
        cls.why_not_implemented = {**gaps, **cls._declared_why_not}

    @classmethod
    def stated_versions(cls) -> dict[str, str]:
        """The versions this target states it runs (``TargetFacts.package_versions``): the imported vLLM's."""
        version = vllm_version()
        return {} if version == "unknown" else {"vllm": version}

    @classmethod
    def _resolved_kernel_ops(cls) -> dict[str, Callable]:
        kernel_names = ops_at(Level.KERNEL)
        resolved = {}
        for op, kernel in cls.kernel_ops.items():
            if op not in kernel_names:
                raise TypeError(f"{cls.__qualname__}.kernel_ops names {op!r}, which is not a kernel op; "
                                f"kernel ops: {', '.join(kernel_names)}")
            if isinstance(kernel, str):
                kernel = resolve_dotted(kernel, cls.name, f"kernel_ops[{op!r}]", cls.wrapper_package)
            if isinstance(kernel, KernelAdapter):  # another signature, declared: checked against the op's spec here
                kernel = kernel.for_op(op)
            if not callable(kernel):
                raise TypeError(f"{cls.__qualname__}.kernel_ops[{op!r}] is {kernel!r}, not a callable")
            resolved[op] = kernel
        return resolved

    def __init__(self) -> None:
        super().__init__()
        self.wrapper = None
        self.serving_wrapper = None  # the one wrapper of a serving sequence (start_serving)
        self.mapping: LoRAMapping | None = None
        for op, kernel in self.kernel_ops.items():  # vLLM's names and order: the suite calls them as they are
            setattr(self, op, kernel)

    # -- case-level refusals ----------------------------------------------------------------------------

    def supports_bias(self) -> bool:
        """Whether the installed wrapper takes LoRA bias: its ``add_lora_linear`` names ``lora_bias_stacked``."""
        method = getattr(self.wrapper_class, "add_lora_linear", None)
        return method is not None and accepts_keyword(method, "lora_bias_stacked")

    def unsupported_reason(self, case) -> str | None:
        if (reason := super().unsupported_reason(case)) is not None:  # the op itself, then the dtype
            return reason
        if needs_lora_bias(case) and not self.supports_bias():
            return (f"{self.wrapper_class.__qualname__} (vLLM {vllm_version()}) takes no LoRA bias: its add_lora_linear "
                    "has no lora_bias_stacked parameter")
        if case.op in moe.MOE_WRAPPER_OPS:
            return self.moe_case_reason(case)
        return None

    def moe_case_reason(self, case) -> str | None:
        """What vLLM's ``add_lora_w13``/``add_lora_w2`` cannot express of this neutral MoE case."""
        if not case.add_inputs and not accepts_keyword(getattr(self.wrapper_class, case.op), "add_inputs"):
            return f"the installed vLLM {vllm_version()}'s {self.wrapper_class.__qualname__}.{case.op} has no add_inputs"
        return moe.moe_wrapper_unsupported_reason(case)

    # -- the wrapper's life: constructed and given the batch's metadata -------------------------------------

    def construct_wrapper(self, mapping: LoRAMapping):
        """The wrapper that runs this batch, built as vLLM's model manager builds one:
        ``wrapper_class(max_num_batched_tokens, max_batches, device, lora_config=…)``, sized to the batch;
        ``lora_config`` only where the constructor takes it. Override to build it otherwise (keep a
        wrapper across batches, pass what a constructor of your own needs)."""
        tokens = max(len(mapping.token_slots), len(mapping.sampled_slots), 1)
        batches = max(len(mapping.seq_lens), 1)
        kwargs = {}
        if takes_keyword(self.wrapper_class.__init__, "lora_config"):
            config = _default_lora_config(mapping.num_slots)
            if config is not None:
                kwargs["lora_config"] = config
        return self.wrapper_class(tokens, batches, self.device, **kwargs)

    # vLLM's GPU runner: the mapping covers a batch's real tokens, the layer gets the rows padded to a graph's size
    serving_padding: ClassVar[str] = "real-rows"
    # the one wrapper of a serving sequence (start_serving); None: each batch builds its own. A class default as
    # well, so that a subclass whose __init__ does not call this one's still builds a wrapper per batch.
    serving_wrapper = None

    def start_serving(self, capacity) -> None:
        """One wrapper for a whole serving sequence, as vLLM's model manager builds one at start-up:
        ``construct_wrapper`` given the largest batch (``capacity.max_tokens`` tokens in ``capacity.max_batches``
        sequences); ``update_metadata`` then writes every step's batch into that wrapper's buffers."""
        seqs = max(1, min(capacity.max_batches, capacity.max_tokens))
        lens = tuple(capacity.max_tokens // seqs + (i < capacity.max_tokens % seqs) for i in range(seqs))
        largest = LoRAMapping((-1,) * capacity.max_tokens, (-1,) * seqs, lens, False, capacity.num_slots)
        self.serving_wrapper = self.construct_wrapper(largest)

    def update_metadata(self, mapping: LoRAMapping) -> None:
        self.mapping = mapping
        self.wrapper = self.serving_wrapper if self.serving_wrapper is not None else self.construct_wrapper(mapping)
        # max_loras = slots + 1, as vLLM's LoRAModelManager passes lora_slots + 1 (it places the −1 rows of
        # sampler_indices_padded, which no wrapper method of vLLM 0.32 reads).
        self.wrapper.update_metadata(
            vllm_lora_mapping(mapping),
            lora_index_to_id(mapping.num_slots),
            mapping.num_slots + 1,
            **update_metadata_kwargs(self.wrapper.update_metadata),
        )

    def call_wrapper(self, method: str, arguments: dict[str, Any], lora_bias_stacked=None,
                     extra: Mapping[str, Any] | None = None) -> Any:
        """``self.wrapper.<method>`` with the suite's ``arguments`` by name (so a release that takes LoRA bias
        positionally, or orders its parameters otherwise, gets each in its place), ``lora_bias_stacked``
        where the installed method names it, and the caller's other keywords as they came; what it returns is
        returned, and taken as the new ``y`` where the platform cannot update in place (``can_update_inplace``).
        A subclass overrides this to do what its platform's runner does around each call."""
        function = getattr(self.wrapper, method)
        if accepts_keyword(function, "lora_bias_stacked"):
            arguments = {**arguments, "lora_bias_stacked": lora_bias_stacked}
        elif lora_bias_stacked is not None:
            raise NotImplementedError(f"{type(self.wrapper).__qualname__}.{method} takes no lora_bias_stacked")
        returned = function(**arguments, **(extra or {}))
        if not self.can_update_inplace and method in RESULT_METHODS:
            take_result(self.name, method, returned, arguments["y"])
        return returned

    def token_lora_slots(self):
        return self.wrapper.token_lora_indices  # what vLLM's token head reads

    # -- the ops, forwarded ----------------------------------------------------------------------------------

    @forwarded()
    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        self.call_wrapper("add_shrink", dict(y=y, x=x, lora_a_stacked=lora_a_stacked, scale=scale), extra=kwargs)

    @forwarded()
    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, *, lora_bias_stacked=None, **kwargs):
        arguments = dict(y=y, x=x, lora_b_stacked=lora_b_stacked, output_slices=output_slices, offset_start=offset_start,
                         add_inputs=add_inputs)
        self.call_wrapper("add_expand", arguments, lora_bias_stacked, kwargs)

    @forwarded()
    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, lora_bias_stacked=None,
                        **kwargs):
        arguments = dict(y=y, x=x, lora_a_stacked=lora_a_stacked, lora_b_stacked=lora_b_stacked, scale=scale,
                         output_slices=output_slices, buffer=buffer)
        self.call_wrapper("add_lora_linear", arguments, lora_bias_stacked, kwargs)

    @forwarded()
    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        self.call_wrapper("add_lora_embedding", dict(y=y, x=x, lora_b_stacked=lora_b_stacked, add_inputs=add_inputs), extra=kwargs)

    @forwarded()
    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        arguments = dict(y=y, x=x, lora_a_stacked=lora_a_stacked, lora_b_stacked=lora_b_stacked, scale=scale, buffer=buffer)
        self.call_wrapper("add_lora_logits", arguments, extra=kwargs)

    @forwarded()
    def apply_lora_full_linear(self, y, x, weight_stacked, bias_stacked, module_enabled):
        arguments = dict(y=y, x=x, weight_stacked=weight_stacked, bias_stacked=bias_stacked, module_enabled=module_enabled)
        self.call_wrapper("apply_lora_full_linear", arguments)

    @forwarded("add_shrink")
    def token_classification_head(self, y, x, weight_stacked, bias_stacked, module_enabled):
        TokenHeadFromShrink.token_classification_head(self, y, x, weight_stacked, bias_stacked, module_enabled)

    # vLLM 0.34's layers over the wrapper's methods: the layer's code (as the token head above), where the vLLM has it
    grouped_lora_linear = Vllm034LayerMethod(Vllm034Layers.grouped_lora_linear, ("add_lora_linear",))
    fp32_output_lora_linear = Vllm034LayerMethod(Vllm034Layers.fp32_output_lora_linear, ("add_lora_linear",))
    scaled_embedding_lora = Vllm034LayerMethod(Vllm034Layers.scaled_embedding_lora, ("add_lora_embedding",))

    # vLLM's MoE LoRA methods take what its layer has at hand (Triton tile shapes, sorted ids): vllm_cuda_moe
    # expresses the neutral contract in them. w2 recomputes w13's alignment with the wrapper's own method.
    @forwarded("add_lora_w13")
    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                     expert_map=None, offset=0, add_inputs=True, **kwargs) -> None:
        moe.add_lora_w13(self.wrapper, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled,
                         expert_map=expert_map, offset=offset, add_inputs=add_inputs)

    @forwarded("add_lora_w2", "moe_lora_align_block_size")
    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                    expert_map=None, offset=0, add_inputs=True, **kwargs) -> None:
        moe.add_lora_w2(self.wrapper, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled,
                        expert_map=expert_map, offset=offset, add_inputs=add_inputs)
