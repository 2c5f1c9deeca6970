"""The device layer: where the HPU implementation's tensors live and what the device needs between ops.

The implementation (``engine``, ``wrapper``, ``kernels``) is device-agnostic PyTorch. What differs
between Gaudi and the CPU emulation is concentrated here, in the style of vLLM's "fake HPU"
(docs/gaudi-lora.md §4):

=====================  ==========================================  ==============================
hook                   Gaudi (:class:`HpuDeviceLayer`)             CPU (:class:`CpuDeviceLayer`)
=====================  ==========================================  ==============================
``device``             ``hpu``                                     ``cpu``
``after_op()``         lazy mode: ``htcore.mark_step()``, so the   no-op
                       accumulated graph runs before outputs
                       are read
``synchronize()``      ``mark_step`` (lazy) + ``torch.hpu.         no-op
                       synchronize()``
``prepare(fn)``        compile mode: ``torch.compile(fn,           ``fn`` (or ``torch.compile`` with
                       backend="hpu_backend", dynamic=False)``;    a given backend, for tests)
                       lazy + HPU graphs: ``wrap_in_hpu_graph``
``check_placement(t)`` ``t`` must be on ``hpu``                    no-op
=====================  ==========================================  ==============================

Loading the Habana runtime (:func:`load_runtime`) happens only when the ``hpu`` target is asked for,
never at import time, and configures it *before* the first import, because the bridge reads its
environment once:

* ``PT_HPU_PLACE_ON_CPU=none``: ops the bridge cannot run on the device raise instead of silently
  falling back to the CPU (the bridge's own tests do the same). If ``habana_frameworks.torch`` was
  already imported by someone else without it, the target refuses to run rather than guess;
* ``PT_HPU_LAZY_MODE``: ``1`` for lazy mode (the only mode with HPU graphs), ``0`` for eager mode and
  ``torch.compile``. The mode comes from the target's ``mode`` option, else ``LORA_CONFORMANCE_HPU_MODE``
  (``lazy`` | ``eager`` | ``compile``), else an existing ``PT_HPU_LAZY_MODE``, else the bridge's own
  default (read back with ``habana_frameworks.torch.utils.internal.is_lazy()``).
``LORA_CONFORMANCE_HPU_GRAPHS=1`` (or ``hpu_graphs=True``) wraps the core functions in HPU graphs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ..base import TargetUnavailable
from ..capture import emulated_capture, hpu_graph_capture

ENV_MODE = "LORA_CONFORMANCE_HPU_MODE"
ENV_GRAPHS = "LORA_CONFORMANCE_HPU_GRAPHS"
MODES = ("lazy", "eager", "compile")
BRIDGE = "habana_frameworks"
BRIDGE_DESCRIPTION = (
    "habana_frameworks (Intel Gaudi's PyTorch bridge, not on PyPI: install Habana's PyTorch stack on a Gaudi "
    "machine with habanalabs-installer.sh install --type pytorch, or use a vault.habana.ai gaudi-docker image)"
)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class CpuDeviceLayer:
    """The emulation: tensors on the CPU and every hook a no-op (optionally ``torch.compile``, for tests)."""

    name = "cpu"

    def __init__(self, compile_backend: str | Callable | None = None) -> None:
        self.device = torch.device("cpu")
        self.compile_backend = compile_backend
        self.mode = "compile" if compile_backend is not None else "eager"

    def after_op(self) -> None:
        """Called after every op call, before the caller may read outputs."""

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def prepare(self, fn: Callable) -> Callable:
        """The form in which a core function runs (compiled, graph-captured, or as is)."""
        if self.compile_backend is None:
            return fn
        return torch.compile(fn, backend=self.compile_backend, dynamic=False)

    def check_placement(self, tensor: torch.Tensor) -> None:
        """Raise when a result did not land on this layer's device."""

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        """A serving step recorded once and replayed: the CPU graph emulation (``conformance.targets.capture``)."""
        return emulated_capture(step)

    def describe(self) -> str:
        return f"cpu ({self.mode})"


# -- Gaudi -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HpuRuntime:
    """The loaded Habana bridge: its modules and the execution mode it runs in (process-wide)."""

    htorch: ModuleType  # habana_frameworks.torch (hpu.wrap_in_hpu_graph)
    htcore: ModuleType  # habana_frameworks.torch.core (mark_step)
    lazy: bool
    device: torch.device
    synchronize: Callable[[], None]  # torch.hpu.synchronize, registered by the bridge


_RUNTIME: HpuRuntime | None = None


def requested_mode(mode: str | None = None) -> str | None:
    """The mode asked for (option, else environment), or ``None`` to take the bridge's default."""
    mode = mode or os.environ.get(ENV_MODE) or None
    if mode is None:
        lazy_env = os.environ.get("PT_HPU_LAZY_MODE")
        if lazy_env is None:
            return None
        return "lazy" if lazy_env.strip() == "1" else "eager"
    mode = mode.strip().lower()
    if mode not in MODES:
        raise TargetUnavailable(f"HPU mode {mode!r} (from the option or {ENV_MODE}) is not one of {', '.join(MODES)}")
    return mode


def graphs_requested(hpu_graphs: bool | None = None) -> bool:
    if hpu_graphs is not None:
        return hpu_graphs
    return os.environ.get(ENV_GRAPHS, "").strip().lower() in ("1", "true", "yes", "on")


def bridge_missing_reason(target: str) -> str | None:
    """``None`` when ``habana_frameworks`` can be found; else the one-line reason (no import happens)."""
    if importlib.util.find_spec(BRIDGE) is None:
        return f"target {target!r} needs {BRIDGE_DESCRIPTION}, which is not installed"
    return None


def load_runtime(mode: str | None, target: str = "hpu") -> HpuRuntime:
    """Load (once per process) and check the Habana runtime; :class:`TargetUnavailable` says what is missing."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = _load(mode, target)
    if mode == "lazy" and not _RUNTIME.lazy or mode in ("eager", "compile") and _RUNTIME.lazy:
        loaded = "lazy" if _RUNTIME.lazy else "eager/compile"
        raise TargetUnavailable(
            f"target {target!r} was asked for {mode} mode, but the Habana runtime is already loaded in {loaded} mode "
            "in this process; set PT_HPU_LAZY_MODE before the process starts"
        )
    return _RUNTIME


def _load(mode: str | None, target: str) -> HpuRuntime:
    reason = bridge_missing_reason(target)
    if reason:
        raise TargetUnavailable(reason)
    if "habana_frameworks.torch" not in sys.modules:
        # The bridge reads both at load time; setting them later has no effect.
        os.environ["PT_HPU_PLACE_ON_CPU"] = "none"
        if mode is not None:
            os.environ["PT_HPU_LAZY_MODE"] = "1" if mode == "lazy" else "0"
    elif os.environ.get("PT_HPU_PLACE_ON_CPU", "").strip().lower() != "none":
        raise TargetUnavailable(
            f"target {target!r}: {BRIDGE} was imported before the target could set PT_HPU_PLACE_ON_CPU=none, so ops "
            "may silently fall back to the CPU; export PT_HPU_PLACE_ON_CPU=none before starting the run"
        )
    try:
        htorch = importlib.import_module("habana_frameworks.torch")
        htcore = importlib.import_module("habana_frameworks.torch.core")
    except Exception as exc:
        raise TargetUnavailable(
            f"target {target!r} needs {BRIDGE}, but habana_frameworks.torch failed to import: {_one_line(exc)}"
        ) from exc
    hpu = getattr(torch, "hpu", None)
    if hpu is None or not hpu.is_available():
        raise TargetUnavailable(
            f"target {target!r} needs a Gaudi device, but torch.hpu.is_available() is False "
            "(check hl-smi and HABANA_VISIBLE_DEVICES)"
        )
    runtime = HpuRuntime(htorch, htcore, _is_lazy(), torch.device("hpu"), hpu.synchronize)
    _probe_placement(runtime, target)
    return runtime


def _is_lazy() -> bool:
    try:
        return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
    except Exception:  # noqa: BLE001 - older/newer bridges: fall back to the variable it reads
        return os.environ.get("PT_HPU_LAZY_MODE", "0").strip() == "1"


def _probe_placement(runtime: HpuRuntime, target: str) -> None:
    """Run both variants' math once on tiny tensors and check the result lives on the device.

    With the CPU fallback refused, an op the device cannot run raises here, once, with a clear
    message, instead of breaking every case.
    """
    from . import gather_math, mask_math, writeback  # the math does not import this module: no cycle
    from .buckets import BucketPolicy
    from .rows import PaddedRows
    from .stacks import flat_a, flat_b, upcast_3d

    device, dtype = runtime.device, torch.bfloat16
    try:
        rows = PaddedRows.from_slots(torch.tensor([0, -1, 1]), BucketPolicy(), device)  # padded to 4 rows
        x = torch.ones(4, 8, device=device, dtype=dtype)
        a = torch.ones(2, 1, 2, 8, device=device, dtype=dtype)
        b = torch.ones(2, 1, 4, 2, device=device, dtype=dtype)
        mask = rows.mask(2, 2)
        masked = mask_math.linear(x, flat_a(a), flat_b(b), mask, 1.0, dtype)
        shrunk = mask_math.shrink_rows(x, flat_a(a), mask, 1.0, 2)
        masked = masked + mask_math.expand_rows(shrunk, flat_b(b), mask, dtype)
        gathered = gather_math.linear(x, upcast_3d(a), upcast_3d(b), rows.gather_index, rows.row_active, 1.0, dtype)
        result = writeback.merge(torch.zeros(4, 4, device=device, dtype=dtype), masked + gathered, rows.row_active, True)
        if runtime.lazy:
            runtime.htcore.mark_step()
    except Exception as exc:
        raise TargetUnavailable(f"target {target!r}: a probe op failed on the Gaudi device: {_one_line(exc)}") from exc
    if result.device.type != device.type:
        raise TargetUnavailable(f"target {target!r}: a probe op ran on {result.device}, not on the Gaudi device")


class _Captured(torch.nn.Module):
    """``wrap_in_hpu_graph`` captures modules; this makes a core function one."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class HpuDeviceLayer:
    """Gaudi: tensors on ``hpu``, ``mark_step`` in lazy mode, optional HPU graphs or ``torch.compile``."""

    name = "hpu"

    def __init__(self, runtime: HpuRuntime, mode: str | None = None, hpu_graphs: bool = False) -> None:
        self.runtime = runtime
        self.device = runtime.device
        self.mode = "lazy" if runtime.lazy else (mode if mode in ("eager", "compile") else "eager")
        if hpu_graphs and self.mode != "lazy":
            raise TargetUnavailable("HPU graphs need lazy mode: set PT_HPU_LAZY_MODE=1 (or LORA_CONFORMANCE_HPU_MODE=lazy)")
        self.hpu_graphs = hpu_graphs

    def after_op(self) -> None:
        if self.mode == "lazy":
            self.runtime.htcore.mark_step()

    def synchronize(self) -> None:
        self.after_op()
        self.runtime.synchronize()

    def prepare(self, fn: Callable) -> Callable:
        if self.mode == "compile":
            return torch.compile(fn, backend="hpu_backend", dynamic=False)
        if self.hpu_graphs:
            return self.runtime.htorch.hpu.wrap_in_hpu_graph(_Captured(fn), disable_tensor_cache=True)
        return fn

    def capture(self, step: Callable[[], None]) -> Callable[[], None] | None:
        """A serving step in an HPU graph (lazy mode only: eager and compile mode run steps eagerly, None)."""
        return hpu_graph_capture(step) if self.mode == "lazy" else None

    def check_placement(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type:
            raise RuntimeError(f"an HPU LoRA result landed on {tensor.device}, not on {self.device}")

    def describe(self) -> str:
        return f"hpu ({self.mode}{', HPU graphs' if self.hpu_graphs else ''})"


DeviceLayer = CpuDeviceLayer | HpuDeviceLayer
