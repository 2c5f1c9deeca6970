"""What every generation engine returns, whatever runs underneath (the suite's decoder, vLLM, PEFT).

A request is a prompt and an adapter name (``None`` = the base model). For each generated (or, when
teacher-forced, fed) token an engine reports the token, its log-probability and the top-k
alternatives, so that the comparison in :mod:`conformance.e2e.compare` is the same for every engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Request:
    prompt: str
    adapter: str | None  # None: the base model, no adapter

    def describe(self) -> str:
        return f"{self.adapter or 'base'} · {self.prompt!r}"


@dataclass(frozen=True)
class Step:
    """One position: the token taken there, its log-probability and the top-k ``(token, logprob)``.

    ``routing_margin`` (MoE models, the suite's decoder): the smallest gap, over the layers, between the
    router's k-th and (k+1)-th logits at the token this position's logits are computed from; where it is
    tiny, either expert choice is right (inf: no router, or not reported).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    routing_margin: float = math.inf

    @property
    def margin(self) -> float:
        """Log-probability gap between the best and the second-best token (inf with one candidate)."""
        return self.top[0][1] - self.top[1][1] if len(self.top) > 1 else float("inf")

    @classmethod
    def from_logits(cls, logits: torch.Tensor, token: int | None, top_k: int, routing_margin: float = math.inf) -> Step:
        """From one row of logits; ``token=None`` takes the argmax (greedy)."""
        logprobs = torch.log_softmax(logits.double(), -1)
        values, indices = logprobs.topk(top_k)
        chosen = int(indices[0]) if token is None else token
        return cls(chosen, float(logprobs[chosen]), tuple(zip(indices.tolist(), values.tolist())), float(routing_margin))


@dataclass(frozen=True)
class Generation:
    request: Request
    prompt_ids: tuple[int, ...]
    steps: tuple[Step, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(step.token for step in self.steps)


def slot_assignment(requests: list[Request], max_loras: int) -> tuple[tuple[str | None, ...], list[int]]:
    """Adapters in slots in order of first appearance (empty slots after them), and each request's slot."""
    names: list[str] = []
    for request in requests:
        if request.adapter is not None and request.adapter not in names:
            names.append(request.adapter)
    if len(names) > max_loras:
        raise ValueError(f"the batch uses {len(names)} adapters but only {max_loras} slots (max_loras) exist")
    slots = tuple(names) + (None,) * (max_loras - len(names))
    return slots, [names.index(r.adapter) if r.adapter is not None else -1 for r in requests]
