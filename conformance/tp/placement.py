"""Which device each tensor-parallel rank uses, which collectives join them, and how a result says so.

One pure function, :func:`place_ranks`, decides it for every device type (the CPU's included, so the
path CI runs is the path a GPU lab runs) from four things: how many ranks a case has, which devices
exist here (``visible``: the ids of the visible-devices variable, ``None`` where nothing could count
them), the device type's traits (its visible-devices variable and its own ``torch.distributed``
backend) and ``--devices``.

* The devices are ``--devices``' list, or every visible device (no ``--devices``, or ``auto``), and
  rank ``r`` gets ``devices[r % n]``: with as many devices as ranks each rank has its own (as vLLM runs
  it); with fewer, ranks share them round robin, so a one-GPU machine still runs every TP case.
* Ranks that share a device keep the device's backend only where it accepts that. NCCL does not
  (it refuses two ranks of one communicator on one GPU: "Duplicate GPU detected"), so they fall back to
  gloo, which joins the ranks through host copies of their device tensors
  (``conformance.tp.collectives``): the sharding math still runs on the device's own kernels, only
  the collectives do not. A Gaudi cannot be shared at all: one process acquires a card (Intel Gaudi's
  "Gaudi-to-process Assignment": ``HLS_MODULE_ID`` "must have a different value for every process"),
  so on ``hpu`` fewer devices than ranks stays an error.
* The label (``Placement.label``: "4 ranks on 1 device, gloo collectives") is recorded with every TP
  result, said in its message where ranks share a device, and listed in the report's Run section.

The impure part, counting the devices a runtime sees, is ``conformance.devices.visible_device_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.targets.device_traits import DeviceTraits

# Backends that run two ranks on one device. gloo runs on host memory, so device sharing means nothing
# to it; nccl refuses (above); an unknown device type's backend is not trusted to accept it.
SHARES_DEVICES = frozenset({"gloo"})
FALLBACK_BACKEND = "gloo"

# Device types whose device one process holds alone, with the upstream fact that says so.
EXCLUSIVE_DEVICES = {
    "hpu": "one process acquires a Gaudi (Intel Gaudi docs, Gaudi-to-process Assignment: HLS_MODULE_ID "
           "'must have a different value for every process')",
}

NOT_TP = "or leave the tensor-parallel cases out with -m 'not tp'"


@dataclass(frozen=True)
class Placement:
    """Where a pool's ranks run: ``devices[r]`` is the id rank ``r``'s ``variable`` is set to (``None``: every
    rank on the target's own device, the CPU), ``backend`` the ``torch.distributed`` backend they join with."""

    devices: tuple[str | None, ...]
    variable: str | None
    backend: str
    device_backend: str  # the device type's own backend: ``backend`` differs where ranks share a device it refuses
    label: str

    @property
    def shared(self) -> bool:
        """Whether two ranks use one device."""
        named = [d for d in self.devices if d is not None]
        return len(set(named)) < len(named)

    def env(self, rank: int) -> dict[str, str] | None:
        """The environment rank ``rank`` starts with (its device selected before any runtime loads), or None."""
        device = self.devices[rank]
        return {self.variable: device} if device is not None and self.variable else None

    def to_json(self) -> dict:
        return {"label": self.label, "backend": self.backend, "device_backend": self.device_backend,
                "variable": self.variable, "devices": list(self.devices)}


def _plural(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"


def place_ranks(tp_size: int, visible: list[str] | None, traits: DeviceTraits, devices: list[str] | str | None,
                device_env: str | None = None) -> Placement:
    """The placement of ``tp_size`` ranks (see the module docstring); ``ValueError`` naming the problem and the fix
    where there is none: no visible-devices variable, a listed device that does not exist, no device, a Gaudi shared.

    ``visible``: the device ids that exist here (``conformance.devices.visible_device_ids``), ``None`` where
    unknown (then ``--devices`` is taken as given, and without it rank ``r`` gets device ``r``).
    ``devices``: ``--devices`` parsed (``conformance.devices.parse_devices``). ``device_env``: ``--device-env``.
    """
    backend = traits.distributed_backend
    if backend is None:
        raise ValueError(f"tensor-parallel ranks on {traits.type} need a torch.distributed backend: the target class "
                         "states one in device_traits() (conformance.targets.device_traits.DeviceTraits)")
    if traits.type == "cpu" and devices is None and visible is None:  # nothing selects a device: every rank on the CPU
        return Placement((None,) * tp_size, None, backend, backend, f"{_plural(tp_size, 'rank')} on the CPU, {backend} collectives")
    variable = device_env or traits.visible_devices_env
    if variable is None:
        raise ValueError(f"tensor-parallel ranks on {traits.type} need a visible-devices variable: name it with --device-env=VAR")
    if isinstance(devices, list):
        missing = [d for d in devices if visible is not None and d not in visible]
        if missing:
            raise ValueError(
                f"--devices names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not among the {traits.type} "
                f"devices here ({', '.join(visible) or 'none'}, as {variable} selects them); list only those, or leave out "
                "--devices to use every visible one"
            )
        chosen = devices
    else:  # every visible device; where none could count them, one per rank as device r (the ranks' own start says if not)
        chosen = visible if visible is not None else [str(rank) for rank in range(tp_size)]
    if not chosen:
        raise ValueError(f"no {traits.type} device is visible here ({variable} and the runtime select none): tensor-parallel "
                         f"cases need at least one; run where one is, {NOT_TP}")
    per_rank = tuple(chosen[rank % len(chosen)] for rank in range(tp_size))
    used = len(set(per_rank))
    if used < tp_size and traits.type in EXCLUSIVE_DEVICES:
        raise ValueError(
            f"tensor parallelism {tp_size} on {traits.type} needs {tp_size} devices, one per rank, because "
            f"{EXCLUSIVE_DEVICES[traits.type]}; {_plural(used, 'device')} ({', '.join(chosen)}) "
            f"{'is' if used == 1 else 'are'} here or listed by --devices: list {tp_size}, {NOT_TP}"
        )
    joined = backend if used == tp_size or backend in SHARES_DEVICES else FALLBACK_BACKEND
    return Placement(per_rank, variable, joined, backend, f"{_plural(tp_size, 'rank')} on {_plural(used, 'device')}, {joined} collectives")
