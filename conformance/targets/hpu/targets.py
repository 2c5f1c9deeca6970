"""The targets that run this project's HPU LoRA implementation.

=======================  ========  ============================================================
name                     variant   device layer
=======================  ========  ============================================================
``hpu``                  mask      Gaudi (``habana_frameworks``): lazy, eager or compile mode
``hpu-gather``           gather    Gaudi
``hpu-emulated``         mask      the CPU, every device hook a no-op (CI without Gaudi)
``hpu-emulated-gather``  gather    the CPU
=======================  ========  ============================================================

All four are the same code (``wrapper`` + ``kernels`` over ``engine``); only the variant and the
device layer differ. Options are constructor keywords, defaulting to the environment, since the
registry builds targets without arguments:

* ``buckets``: ``LORA_CONFORMANCE_HPU_BUCKETS`` (``pow2`` default, ``pow2:MIN``, ``none``, ``8,16,32``);
* ``moe_variant``: the fused-MoE LoRA's math, ``LORA_CONFORMANCE_HPU_MOE_VARIANT`` (``grouped`` |
  ``mask`` | ``gather``). Default: ``grouped`` for the mask targets (``grouped_moe``: the grouped work
  with static shapes, its block size chosen per bucket; 21–1,000× fewer FLOPs than the mask, far fewer
  weight bytes than the gather at large batches, no cached float32 stacks; the rule and its measurement:
  docs/hpu.md, *MoE*), ``gather`` for the gather targets (kept whole for comparison);
* Gaudi only: ``mode`` (``LORA_CONFORMANCE_HPU_MODE``: ``lazy`` | ``eager`` | ``compile``; else
  ``PT_HPU_LAZY_MODE``; else the bridge's default) and ``hpu_graphs`` (``LORA_CONFORMANCE_HPU_GRAPHS=1``).

Nothing here imports ``habana_frameworks`` at import time: ``check_available`` of the Gaudi targets
does, through ``device.load_runtime``, after configuring its environment.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from ..base import Target, TargetUnavailable
from .buckets import BucketPolicy
from .device import CpuDeviceLayer, HpuDeviceLayer, graphs_requested, load_runtime, requested_mode
from .engine import MOE_VARIANTS, LoRAEngine
from .kernels import HpuKernelOps
from .wrapper import HpuPunicaWrapper

ENV_BUCKETS = "LORA_CONFORMANCE_HPU_BUCKETS"
ENV_MOE_VARIANT = "LORA_CONFORMANCE_HPU_MOE_VARIANT"


class _HpuImplementationTarget(HpuPunicaWrapper, HpuKernelOps, Target):
    """The shared body: every wrapper method and kernel op, over an engine built from the options."""

    variant: ClassVar[str] = "mask"
    default_moe_variant: ClassVar[str] = "grouped"

    def __init__(self, *, buckets: BucketPolicy | str | None = None, moe_variant: str | None = None) -> None:
        Target.__init__(self)
        if not isinstance(buckets, BucketPolicy):
            try:
                buckets = BucketPolicy.from_spec(buckets if buckets is not None else os.environ.get(ENV_BUCKETS))
            except ValueError as exc:  # a configuration error: say so in one line, as the registry expects
                raise TargetUnavailable(f"target {self.name!r}: {ENV_BUCKETS} or buckets=: {exc}") from None
        self.moe_variant = (moe_variant or os.environ.get(ENV_MOE_VARIANT) or self.default_moe_variant).strip().lower()
        if self.moe_variant not in MOE_VARIANTS:
            raise TargetUnavailable(
                f"target {self.name!r}: {ENV_MOE_VARIANT} or moe_variant= is {self.moe_variant!r}, not one of {', '.join(MOE_VARIANTS)}"
            )
        HpuPunicaWrapper.__init__(self, LoRAEngine(self.variant, buckets, self.device_layer(), self.moe_variant))

    def device_layer(self):
        raise NotImplementedError

    def synchronize(self) -> None:
        self.engine.layer.synchronize()

    def capture(self, step):
        """Serving steps as the device layer captures them: the CPU graph emulation, or HPU graphs in lazy mode."""
        return self.engine.layer.capture(step)

    def describe(self) -> str:
        return (f"{self.name}: {self.variant} variant (MoE: {self.moe_variant}) on {self.engine.layer.describe()}, "
                f"buckets {self.engine.buckets.describe()}")


class HpuEmulatedTarget(_HpuImplementationTarget):
    name = "hpu-emulated"
    description = "this project's mask-based HPU LoRA implementation, run on the CPU (no Gaudi needed)"

    def device_layer(self) -> CpuDeviceLayer:
        return CpuDeviceLayer()


class HpuEmulatedGatherTarget(HpuEmulatedTarget):
    name = "hpu-emulated-gather"
    description = "this project's gather-based (index_select) HPU LoRA variant, run on the CPU"
    variant = "gather"
    default_moe_variant = "gather"


class HpuTarget(_HpuImplementationTarget):
    name = "hpu"
    description = "this project's mask-based HPU LoRA implementation on Intel Gaudi (habana_frameworks)"

    def __init__(
        self, *, mode: str | None = None, hpu_graphs: bool | None = None, buckets: BucketPolicy | str | None = None,
        moe_variant: str | None = None,
    ) -> None:
        # The runtime must be loaded with the requested mode before Target.__init__ checks availability.
        self.mode = requested_mode(mode)
        self.runtime = load_runtime(self.mode, self.name)
        self.hpu_graphs = graphs_requested(hpu_graphs)
        super().__init__(buckets=buckets, moe_variant=moe_variant)

    @classmethod
    def check_available(cls) -> None:
        load_runtime(requested_mode(), cls.name)

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("hpu")

    def device_layer(self) -> HpuDeviceLayer:
        return HpuDeviceLayer(self.runtime, self.mode, self.hpu_graphs)


class HpuGatherTarget(HpuTarget):
    name = "hpu-gather"
    description = "this project's gather-based (index_select) HPU LoRA variant on Intel Gaudi"
    variant = "gather"
    default_moe_variant = "gather"
