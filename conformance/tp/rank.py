"""One rank of a tensor-parallel pool: ``python -m conformance.tp.rank READ_FD WRITE_FD``.

It loads the target by name (``conformance.targets.registry``), joins the pool's ``torch.distributed``
process group (gloo on the CPU, nccl on CUDA, hccl on Gaudi: the target's device type decides), and
then runs its shard of every case its parent (``conformance.tp.pool``) sends: ``update_metadata`` with
the case's mapping, the layer's composition (``conformance.tp.composition``) with the target's wrapper
methods (watched for writes into their inputs, ``conformance.tp.inputs``) and the process group's
collectives. Each rank answers with the gathered output (rank 0; the others ``None``) and the inputs
its calls modified; an exception is answered with its text and its whole traceback, formatted here
(the parent decides the outcome). Like the op worker (``conformance.isolation.child``) it first calls
``conformance.isolation.worker.prepare_child``: it dies with its parent and dumps its Python stacks into
the stack file on a fatal signal or on SIGUSR1, which the parent sends to a rank that hangs.

Messages (pickled, one pipe each way, tagged with ``conformance.isolation.protocol.Tag``): the parent's
configuration dict, answered ``(READY, device description)`` or ``(RAISE, (text, traceback))``; then
each ``(CASE, TPCase)`` is answered ``(OK, (tensor or None, [modified inputs], [BitDifferences of inputs]))``,
``(NOT_SUPPORTED, text)`` (NotImplementedError) or ``(RAISE, (text, traceback))``; ``(EXIT, None)`` ends it.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import sys
from multiprocessing.connection import Connection

from conformance.isolation.protocol import Tag
from conformance.isolation.worker import prepare_child
from conformance.text import describe_exception, format_traceback

COLLECTIVE_TIMEOUT = dt.timedelta(minutes=10)  # the parent's case timeout ends a hung rank long before


def backend_for(target) -> str:
    """The ``torch.distributed`` backend of the target's device type, as its class states it
    (``Target.device_traits``: gloo, nccl, hccl for the built-in device types)."""
    backend = type(target).device_traits().distributed_backend
    if backend is None:
        raise ValueError(
            f"no torch.distributed backend known for device type {target.device.type!r}: the target class states one "
            "in device_traits() (conformance.devices.DeviceTraits)"
        )
    return backend


def _error_text(exc: BaseException) -> str:
    """``"TypeName: message (at file:line)"`` in safe text (``conformance.text.describe_exception``): a
    target's exception can hold surrogates, be 10 MB long or have a ``__str__`` that raises; never raises."""
    return describe_exception(exc)


def _raised(exc: BaseException) -> tuple[str, str]:
    """What a RAISE reply carries: the one-line text and the whole traceback, from the frame of this module
    that caught ``exc`` into the target's (``conformance.text.format_traceback``); safe text, never raises."""
    return _error_text(exc), format_traceback(exc)


def main(argv: list[str]) -> int:
    commands = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)

    def reply(*message) -> None:
        replies.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    config = pickle.loads(commands.recv_bytes())
    prepare_child(config)  # as the op worker: die with the parent, dump stacks where the parent reads them
    if config.get("device_env"):
        os.environ[config["device_env"]] = config["device"]  # before any device runtime loads
    import torch
    import torch.distributed as dist

    torch.set_num_threads(config["torch_threads"])
    from conformance.ops import case_mapping
    from conformance.report.fingerprint import device_description
    from conformance.targets import load

    from .collectives import ProcessGroupCollectives
    from .composition import run_rank, tensors_of
    from .inputs import ReadOnlyInputs

    rank, world_size = config["rank"], config["world_size"]
    try:
        target = load(config["target"])
        backend = backend_for(target)
        dist.init_process_group(backend, init_method=f"file://{config['init_file']}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        reply(Tag.READY, {**device_description(target.device.type), "backend": backend})
    except Exception as exc:  # noqa: BLE001 - the parent reports it for every case
        reply(Tag.RAISE, _raised(exc))
        return 1
    collectives = ProcessGroupCollectives(rank, world_size)
    while True:
        try:
            kind, case = pickle.loads(commands.recv_bytes())
        except EOFError:  # the parent closed the pipe: the run is over
            break
        if kind == Tag.EXIT:
            break
        try:
            target.update_metadata(case_mapping(case))
            watched = ReadOnlyInputs(target)
            output = run_rank(case, tensors_of(case), watched, collectives, rank, target.device)
        except NotImplementedError as exc:
            reply(Tag.NOT_SUPPORTED, _error_text(exc))
        except Exception as exc:  # noqa: BLE001 - any exception from the target is the broken outcome
            reply(Tag.RAISE, _raised(exc))
        else:
            reply(Tag.OK, (output if rank == 0 else None, watched.modified, watched.bit_level))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
