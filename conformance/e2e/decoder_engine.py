"""Generation with the suite's decoder on a target: greedy decoding and teacher-forced scoring.

Greedy decoding prefills every prompt in one packed batch, then decodes one token per sequence per
step (a decode batch), so a target sees both of vLLM's batch kinds. Teacher forcing feeds prompt plus
continuation in one prefill and takes the logits of every position that predicts a continuation token.
A token classifier runs one prefill of every prompt and returns every token's label logits.
"""

from __future__ import annotations

import torch

from .adapters import Adapter
from .checkpoint import Checkpoint
from .decoder import ForwardBatch, LoRADecoder, SequenceCache
from .generation import Generation, Request, Step, slot_assignment
from .lora_stacks import LoRAStacks


def encode_prompt(checkpoint: Checkpoint, tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids as every engine is fed them: BOS, then the prompt without special tokens."""
    return [checkpoint.config.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False).ids


class DecoderEngine:
    def __init__(self, target, checkpoint: Checkpoint, adapters: dict[str, Adapter], dtype: torch.dtype) -> None:
        self.checkpoint, self.adapters, self.dtype = checkpoint, adapters, dtype
        self.decoder = LoRADecoder(checkpoint, dtype, target.device, target)
        self.tokenizer = checkpoint.tokenizer()
        self._stacks: dict[tuple, LoRAStacks] = {}

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.checkpoint, self.tokenizer, prompt)

    def _stacks_for(self, slots: tuple[str | None, ...]) -> LoRAStacks:
        if slots not in self._stacks:
            adapters = tuple(self.adapters[name] if name else None for name in slots)
            self._stacks[slots] = LoRAStacks.build(adapters, self.checkpoint.config, self.dtype, self.decoder.device)
        return self._stacks[slots]

    @property
    def is_token_classifier(self) -> bool:
        return self.checkpoint.config.num_labels is not None

    def generate(self, requests: list[Request], max_new_tokens: int, top_k: int, max_loras: int) -> list[Generation]:
        """Greedy continuations of ``max_new_tokens`` tokens; a token classifier's labels (the argmax at every
        prompt token: nothing is generated, ``max_new_tokens`` is not read)."""
        if self.is_token_classifier:
            return self._labels(requests, None, top_k, max_loras)
        slots, request_slots = slot_assignment(requests, max_loras)
        stacks = self._stacks_for(slots)
        prompts = [self.encode(r.prompt) for r in requests]
        caches = [SequenceCache.empty(self.checkpoint.config.num_hidden_layers) for _ in requests]
        steps: list[list[Step]] = [[] for _ in requests]
        new_tokens = prompts
        for step in range(max_new_tokens):
            sampled = [[len(tokens) - 1] for tokens in new_tokens]
            batch = ForwardBatch(new_tokens, request_slots, caches, sampled, is_prefill=step == 0, num_slots=max_loras)
            logits, routing = self.decoder.forward(batch, stacks)
            for row, taken in enumerate(steps):
                taken.append(Step.from_logits(logits[row], None, top_k, routing[row]))
            new_tokens = [[taken[-1].token] for taken in steps]
        return [Generation(r, tuple(p), tuple(s)) for r, p, s in zip(requests, prompts, steps)]

    def _labels(self, requests: list[Request], given: list[tuple[int, ...]] | None, top_k: int, max_loras: int) -> list[Generation]:
        """Every prompt token's label log-probabilities as the steps of a generation: the given label at each
        token (``None``: the argmax)."""
        prompts = [self.encode(r.prompt) for r in requests]
        for prompt, labels in zip(prompts, given or ()):
            if len(labels) != len(prompt):
                raise ValueError(f"{len(labels)} labels given for a prompt of {len(prompt)} tokens (one per token)")
        generations = []
        for i, (request, prompt, logits) in enumerate(zip(requests, prompts, self.classify(requests, max_loras))):
            labels = given[i] if given is not None else [None] * len(prompt)
            steps = tuple(Step.from_logits(row, label, top_k) for row, label in zip(logits, labels))
            generations.append(Generation(request, tuple(prompt), steps))
        return generations

    def classify(self, requests: list[Request], max_loras: int) -> list[torch.Tensor]:
        """A token classifier's label logits ``[prompt tokens, labels]`` per request, all prompts in one prefill."""
        slots, request_slots = slot_assignment(requests, max_loras)
        stacks = self._stacks_for(slots)
        prompts = [self.encode(r.prompt) for r in requests]
        caches = [SequenceCache.empty(self.checkpoint.config.num_hidden_layers) for _ in requests]
        labels = self.decoder.classify(ForwardBatch(prompts, request_slots, caches, [[] for _ in prompts], True, max_loras), stacks)
        return list(labels.split([len(p) for p in prompts]))

    def score(self, requests: list[Request], continuations: list[tuple[int, ...]], top_k: int, max_loras: int) -> list[Generation]:
        """Teacher-forced: the log-probabilities of each given continuation, token by token; on a token
        classifier the log-probabilities of the given labels, one per prompt token."""
        if self.is_token_classifier:
            return self._labels(requests, continuations, top_k, max_loras)
        slots, request_slots = slot_assignment(requests, max_loras)
        stacks = self._stacks_for(slots)
        prompts = [self.encode(r.prompt) for r in requests]
        fed = [p + list(c[:-1]) for p, c in zip(prompts, continuations)]
        sampled = [list(range(len(p) - 1, len(p) - 1 + len(c))) for p, c in zip(prompts, continuations)]
        caches = [SequenceCache.empty(self.checkpoint.config.num_hidden_layers) for _ in requests]
        logits, routing = self.decoder.forward(ForwardBatch(fed, request_slots, caches, sampled, True, max_loras), stacks)
        generations, row = [], 0
        for request, prompt, continuation in zip(requests, prompts, continuations):
            steps = tuple(Step.from_logits(logits[row + i], token, top_k, routing[row + i]) for i, token in enumerate(continuation))
            generations.append(Generation(request, tuple(prompt), steps))
            row += len(continuation)
        return generations
