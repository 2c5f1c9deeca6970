"""The worker process: ``python -m conformance.isolation.child READ_FD WRITE_FD``.

It loads the target once, then answers calls from its parent (``conformance.isolation.process``) one
at a time, as ``conformance.isolation.protocol`` says: each ``call`` runs one level's target half
(``conformance.isolation.local.LocalExecutor.call``) and its answer goes back as a frame of data
(``conformance.wire``). It never decides an outcome itself; when it dies, hangs or sends what the wire
refuses, the parent does. Before anything else it arranges
(``conformance.isolation.worker.prepare_child``, as every tensor-parallel rank does) that

* it dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so a killed run leaves no process holding a
  device;
* a fatal signal (SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL) dumps every thread's Python stack into the
  stack file the parent named, and so does SIGUSR1, which the parent sends before it stops a case that
  ran past its time: the report can then say where the target was;
* what it prints (stdout, stderr, native code's too) goes to the output file the parent named, which the
  parent reads after each reply (``conformance.isolation.output``): into the report, not the terminal.

Its first message is the target's facts (``conformance.targets.facts.read_facts_here``), read before it
makes the target: a serial run takes them from here and so imports the target once (a framework that
takes 20 s to import pays them once per run, not once more for its facts). Then ``ready`` (or ``raise``,
when the constructor raised), then one answer per call, each with the Python warnings the call raised.
"""

from __future__ import annotations

import sys

from conformance.isolation.protocol import Call, RemoteError, Reply, Tag
from conformance.isolation.worker import flush_output, prepare_child
from conformance.wire import Channel, from_data, to_data


def main(argv: list[str]) -> int:
    channel = Channel(int(argv[0]), int(argv[1]))
    config = channel.receive().body  # from the parent: trusted
    prepare_child(config)
    import torch

    torch.set_num_threads(config["torch_threads"])
    from conformance.isolation.local import LocalExecutor
    from conformance.targets.facts import FACTS, read_facts_here

    facts = read_facts_here(config["target"])  # first: a serial run takes its facts from here, not a process of their own
    channel.send(Tag.FACTS, facts)
    if FACTS not in facts:  # no such target, or it cannot run here: the parent says so
        return 1
    try:
        executor = LocalExecutor(config["target"])
        device = executor.device_description()
    except Exception as exc:  # noqa: BLE001 - the parent reports it for every case
        channel.send(Tag.RAISE, to_data(Reply(-1, "", error=RemoteError.of(exc))))
        return 1
    flush_output()
    channel.send(Tag.READY, {"device": device})
    while True:
        try:
            message = channel.receive()
        except EOFError:  # the parent closed the pipe: the run is over
            return 0
        if message.tag == Tag.EXIT:
            return 0
        call = from_data(Call, message.body)
        try:
            answer = executor.call(call.level, call.half, call.case_id, call.request)
            said, omitted = executor.take_warnings()
            flush_output()  # before the reply: the parent reads this case's output once it has it
            reply = Reply(call.seq, call.case_id, warnings=said, warnings_omitted=omitted)
            channel.send(Tag.OK, {**to_data(reply), "reply": answer})
        except Exception as exc:  # noqa: BLE001 - the harness's own errors (and a reply no frame carries) go back as text
            said, omitted = executor.take_warnings()
            flush_output()
            channel.send(Tag.RAISE, to_data(Reply(call.seq, call.case_id, error=RemoteError.of(exc), warnings=said,
                                                  warnings_omitted=omitted)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
