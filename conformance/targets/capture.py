"""Captured graphs: how a target records one serving step once and replays it step after step.

vLLM captures a CUDA graph per batch-size bucket (and, for LoRA, per rounded count of active adapters),
vllm-gaudi an HPU graph per bucket; both then write each step's data into the same persistent tensors
and replay. A replay re-runs the device work recorded at capture and nothing else: every value the
host read at capture (``.item()``, ``.tolist()``, a Python ``if`` on a tensor), every shape and every
Python branch taken is frozen into the graph. Most serving bugs of LoRA live there (a "no LoRA in this
batch" flag read at capture, a grid sized to the capture-time adapter count, metadata written into a
buffer the graph does not read).

A target says how it captures with ``Target.capture(step)`` (``conformance.targets.base``): it returns
what replays the step, or ``None`` when it runs every step eagerly. This module holds the three ways:

* :func:`emulated_capture`: for CPU targets (and ``hpu-emulated``), a graph emulation that freezes what a
  graph freezes. It runs the step once under a dispatch mode that records every torch op with its
  arguments; the replay runs the recorded ops again. Tensors the step did not create (the persistent
  buffers, the weights, the metadata the target keeps) are read by reference, so a replay sees their
  current contents; tensors the step created are computed again by the replay into the very tensors the
  capture made (a graph's memory keeps its addresses: what one graph made and the target kept, a later graph
  or step reads, updated, as on a device); host-side values the step read are the capture's. So a target
  that keeps its state where a graph can see it passes, and one that reads a host value at capture, or
  writes new metadata into a new tensor, fails here as it would on a device;
* :func:`cuda_graph_capture`: ``torch.cuda.CUDAGraph`` after a warm-up on a side stream, as vLLM does;
* :func:`hpu_graph_capture`: Habana's ``HPUGraph`` (imported only on that path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

Step = Callable[[], None]

# Ops whose result is a host value: at capture the host reads it, and a graph keeps that reading (the
# replay does not read it again: it is a host sync, and what the host decided from it is already frozen).
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}


@dataclass(frozen=True)
class ServingCapacity:
    """What a serving target is built for once, before its first step (vLLM's ``max_num_batched_tokens``,
    ``max_num_seqs``, ``max_loras``, ``max_lora_rank``, and the batch sizes and adapter counts it captures)."""

    max_tokens: int
    max_batches: int
    num_slots: int
    max_rank: int
    captured_sizes: tuple[int, ...] = ()
    captured_adapter_counts: tuple[int, ...] = ()


class _Produced:
    """A reference, in a recorded op's arguments, to the output of an earlier recorded op."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Recorder(TorchDispatchMode):
    """Runs ops as they come and records each with its arguments, telling made tensors from outside ones."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, int]] = []  # (op, (args, kwargs) with made tensors as _Produced, outputs)
        self.made: dict[int, int] = {}  # id() of a tensor a recorded op returned -> its output index
        # every op's outputs at capture, by output index: where a replay writes; holding them also keeps every id
        # above alive, so no id is reused during the capture
        self.captured: list[Any] = []

    def _refer(self, value):
        if isinstance(value, torch.Tensor) and id(value) in self.made:
            return _Produced(self.made[id(value)])
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.__name__.split(".")[0] in HOST_READS:
            return result
        recorded_args = tree_map(self._refer, (args, kwargs))
        flat, _ = tree_flatten(result)
        for value in flat:
            if isinstance(value, torch.Tensor) and id(value) not in self.made:
                self.made[id(value)] = len(self.captured)  # its output index
            self.captured.append(value)
        self.ops.append((func, recorded_args, len(flat)))
        return result


class EmulatedGraph:
    """The ops one step ran at capture, replayed on the tensors they named (see the module docstring)."""

    def __init__(self, ops: list, captured: list) -> None:
        self.ops = ops
        self.captured = captured  # each output as the capture made it: the replay writes its values there

    def __call__(self) -> None:
        made: list[Any] = []

        def resolve(value):
            return made[value.index] if isinstance(value, _Produced) else value

        for func, recorded, count in self.ops:
            args, kwargs = tree_map(resolve, recorded, is_leaf=lambda v: isinstance(v, _Produced))
            result = func(*args, **kwargs)
            flat, _ = tree_flatten(result)
            if len(flat) != count:  # the same op on the same shapes: only a broken op changes its arity
                raise RuntimeError(f"replaying {func}: {len(flat)} outputs where the capture had {count}")
            for value in flat:
                kept = self.captured[len(made)]
                if isinstance(value, torch.Tensor) and isinstance(kept, torch.Tensor) and not _same_memory(value, kept):
                    kept.copy_(value)  # the capture's tensor, at its address, holds this replay's values
                    value = kept
                made.append(value)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements (an in-place op's result, or a view made again of the same tensor)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def emulated_capture(step: Step) -> EmulatedGraph:
    """Run ``step`` once, recording it; the returned graph replays what it recorded (see the module docstring)."""
    recorder = _Recorder()
    with recorder:
        step()
    return EmulatedGraph(recorder.ops, recorder.captured)


def cuda_graph_capture(step: Step) -> Step:
    """``step`` captured in a ``torch.cuda.CUDAGraph`` after a warm-up on a side stream (as vLLM's runner does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the warm-up: allocator and library handles made outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def hpu_graph_capture(step: Step) -> Step:
    """``step`` captured in a Habana ``HPUGraph`` (lazy mode), replayed with ``replay()``."""
    import habana_frameworks.torch as htorch  # only on the hpu path: not on PyPI

    step()  # the warm-up, as for CUDA graphs
    htorch.core.mark_step()
    graph = htorch.hpu.HPUGraph()
    stream = htorch.hpu.Stream()
    with htorch.hpu.stream(stream):
        graph.capture_begin()
        step()
        graph.capture_end()
    return graph.replay


__all__ = ["EmulatedGraph", "ServingCapacity", "Step", "cuda_graph_capture", "emulated_capture", "hpu_graph_capture"]
