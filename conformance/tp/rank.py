"""One rank of a tensor-parallel pool: ``python -m conformance.tp.rank READ_FD WRITE_FD``.

It loads the target by name (``conformance.targets.registry``) on the device its pool placed it on
(``conformance.tp.placement``: the visible-devices variable set before any runtime loads), joins the
pool's ``torch.distributed`` process group with the backend the placement chose (the device type's own:
gloo on the CPU, nccl on CUDA, hccl on Gaudi; gloo, through host copies, for ranks sharing a GPU), and
then runs its shard of every case its parent (``conformance.tp.pool``) sends: ``update_metadata`` with
the case's mapping, the layer's composition (``conformance.tp.composition``), on the tensors the request
carries (the referee drew them: a rank draws nothing), with the target's wrapper
methods (watched for writes into their inputs, ``conformance.tp.inputs``) and the process group's
collectives (a serving request runs a whole sequence of steps on a new instance of the target instead:
``conformance.tp.serving_rank``). Each rank answers with the gathered output (rank 0; the others ``None``) and the inputs
its calls modified; an exception is answered with its text and its whole traceback, formatted here
(the parent decides the outcome). Like the op worker (``conformance.isolation.child``) it first calls
``conformance.isolation.worker.prepare_child``: it dies with its parent and dumps its Python stacks into
the stack file on a fatal signal or on SIGUSR1, which the parent sends to a rank that hangs.

It talks the dialect of the op worker (``conformance.isolation.protocol``), frames of data
(``conformance.wire``): the ``config`` is answered ``ready`` (its device and backend) or ``raise``; each
``call`` (level ``layer``, the case's JSON) is answered ``ok`` with ``{"output": tensor or null,
"modified": [text], "bit_level": [BitDifferences]}`` (the gathered output on rank 0 only),
``not_supported`` (``NotImplementedError``) or ``raise``; between them, ``collective`` messages say when
the rank enters and leaves a collective, so the pool can tell a rank that hangs from one that waits
for it; ``exit`` ends it.
"""

from __future__ import annotations

import datetime as dt
import os
import sys

from conformance.isolation.protocol import Call, RemoteError, Reply, Tag
from conformance.isolation.worker import prepare_child
from conformance.text import describe_exception
from conformance.wire import Channel, from_data, to_data

COLLECTIVE_TIMEOUT = dt.timedelta(minutes=10)  # the parent's case timeout ends a hung rank long before



def main(argv: list[str]) -> int:
    channel = Channel(int(argv[0]), int(argv[1]))
    config = channel.receive().body  # from the parent: trusted
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
    from .composition import run_rank
    from .inputs import ReadOnlyInputs
    from .layer_wire import read_request
    from .serving_rank import serve_rank

    rank, world_size = config["rank"], config["world_size"]
    try:
        target = load(config["target"])
        backend = config["backend"]
        dist.init_process_group(backend, init_method=f"file://{config['init_file']}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        channel.send(Tag.READY, {"device": {**device_description(target.device.type), "backend": backend}})
    except Exception as exc:  # noqa: BLE001 - the parent reports it for every case
        channel.send(Tag.RAISE, to_data(Reply(-1, "", error=RemoteError.of(exc))))
        return 1
    current = [-1]  # the call being run, for the collective messages
    collectives = ProcessGroupCollectives(rank, world_size, lambda inside: channel.send(Tag.COLLECTIVE, {"seq": current[0], "in": inside}),
                                          on_host=backend == "gloo")  # a no-op for CPU tensors
    while True:
        try:
            message = channel.receive()
        except EOFError:  # the parent closed the pipe: the run is over
            break
        if message.tag == Tag.EXIT:
            break
        call = from_data(Call, message.body)
        current[0] = call.seq
        try:
            if call.request.get("serving"):  # a whole serving sequence on a new instance (conformance.tp.serving_rank)
                answer = to_data(serve_rank(call.request, config["target"], target, collectives, rank))
            else:
                case, tensors = read_request(call.request)
                target.update_metadata(case_mapping(case))
                watched = ReadOnlyInputs(target)
                output = run_rank(case, tensors, watched, collectives, rank, target.device)
                answer = {"output": output if rank == 0 else None, "modified": watched.modified,
                          "bit_level": [entry.to_json() for entry in watched.bit_level]}
        except NotImplementedError as exc:
            channel.send(Tag.NOT_SUPPORTED, to_data(Reply(call.seq, call.case_id, message=describe_exception(exc))))
        except Exception as exc:  # noqa: BLE001 - any exception from the target is the broken outcome
            channel.send(Tag.RAISE, to_data(Reply(call.seq, call.case_id, error=RemoteError.of(exc))))
        else:
            channel.send(Tag.OK, {**to_data(Reply(call.seq, call.case_id)), "reply": answer})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
