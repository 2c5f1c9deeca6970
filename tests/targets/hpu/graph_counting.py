"""What the static-shape tests of the HPU code share: a torch.compile backend that counts the graphs it
is handed, and a fresh dynamo whose recompile limits are out of reach."""

from __future__ import annotations

import contextlib

import torch


class CountingBackend:
    """A torch.compile backend that counts the graphs it is handed and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@contextlib.contextmanager
def fresh_dynamo():
    """dynamo reset before and after; a hit recompile limit would silently fall back to eager and freeze
    the counter, so the limits are kept out of reach."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        yield
    torch._dynamo.reset()
