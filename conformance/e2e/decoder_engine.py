"""Generation with the suite's decoder on a target: greedy decoding and teacher-forced scoring.

Greedy decoding prefills every prompt in one packed batch, then decodes one token per sequence per
step (a decode batch), so a target sees both of vLLM's batch kinds. Teacher forcing feeds prompt plus
continuation in one prefill and takes the logits of every position that predicts a continuation token.
A token classifier runs one prefill of every prompt and returns every token's label logits.

Two other ways to run the same engine, for the checks every end-to-end case adds (docs/e2e.md):

* LoRA disabled (``lora=False``): the same decoder on the target's device with no LoRA call at all (no
  ``update_metadata``, no wrapper method): the engine as vLLM's ``enable_lora=False`` builds it. Base
  requests must get from it what they get beside adapter requests (base-request invariance);
* captured graphs (``graphs=True``): the prefill runs eagerly, and every decode step replays graphs the
  target captured (``Target.capture``) at the first decode step of each padded batch size, piecewise as vLLM's
  piecewise CUDA graphs run a model: each LoRA call site of the step is one graph on persistent buffers (its
  activations copied in, padded to the captured size, its output copied out), the attention between them
  runs eagerly, the adapters are written into stacks allocated once (``load_in_place``) and the mapping is
  written with ``update_metadata`` before each replay, for the padded batch (:class:`GraphWrapper`).
"""

from __future__ import annotations

import dataclasses

import torch

from conformance.reference.mapping import LoRAMapping

from .adapters import Adapter
from .checkpoint import Checkpoint
from .decoder import ForwardBatch, LoRADecoder, SequenceCache
from .generation import Generation, Request, Step, slot_assignment
from .lora_stacks import LoRAStacks, load_in_place, stack_tensors

# The decode batch sizes graphs are captured for (vLLM's first cudagraph_capture_sizes: 1, 2, 4, then steps of 8);
# a batch is padded to the smallest that holds it.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32)
LORA_METHODS = ("add_lora_embedding", "add_lora_linear", "add_lora_logits", "add_lora_w13", "add_lora_w2", "add_shrink")


def encode_prompt(checkpoint: Checkpoint, tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids as every engine is fed them: BOS, then the prompt without special tokens."""
    return [checkpoint.config.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False).ids


class WithoutLoRA:
    """The wrapper of an engine built without LoRA: on the target's device, and no LoRA call reaches anything."""

    def __init__(self, target) -> None:
        self.device, self._target = target.device, target

    def update_metadata(self, mapping) -> None:
        pass

    def synchronize(self) -> None:
        self._target.synchronize()

    def __getattr__(self, name: str):
        if name in LORA_METHODS:
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def padded_size(rows: int) -> int:
    """The captured batch size a decode batch of ``rows`` sequences is padded to."""
    for size in CAPTURE_SIZES:
        if size >= rows:
            return size
    raise ValueError(f"a decode batch of {rows} sequences is larger than the largest captured size {CAPTURE_SIZES[-1]}")


class GraphWrapper:
    """A target's LoRA calls of one decode step, each replayed from a graph the target captured.

    One graph per (padded batch size, call site: the n-th LoRA call of the step), captured on first use with
    ``target.capture``. Its tensors are persistent: the stacks (written in place per batch) and, per graph, a
    buffer for every other tensor argument, of the padded size (rows beyond the real ones zero). Each call
    copies its arguments into the buffers, replays, and copies the output (the first argument, which every
    wrapper method writes) back. ``update_metadata`` pads the mapping to the captured size as the target's
    ``serving_padding`` asks: ``"explicit"`` gives the padded rows slot −1, ``"real-rows"`` maps the real rows only.
    """

    def __init__(self, target, stacks: LoRAStacks) -> None:
        self.target, self.device = target, target.device
        self._persistent = {id(t) for t in stack_tensors(stacks)}
        self._graphs: dict[tuple, tuple] = {}  # (padded size, call index, method) -> (buffers, replay)
        self._size, self._call = 1, 0

    def update_metadata(self, mapping: LoRAMapping) -> None:
        rows = len(mapping.token_slots)
        self._size, self._call = padded_size(rows), 0
        if self.target.serving_padding == "explicit":
            pad = (-1,) * (self._size - rows)
            mapping = LoRAMapping(mapping.token_slots + pad, mapping.sampled_slots + pad, mapping.seq_lens + (1,) * len(pad),
                                  mapping.is_prefill, mapping.num_slots)
        self.target.update_metadata(mapping)

    def synchronize(self) -> None:
        self.target.synchronize()

    def __getattr__(self, name: str):
        if name not in LORA_METHODS:
            raise AttributeError(name)
        return lambda *args, **kwargs: self._replay(name, args, kwargs)

    def _replay(self, name: str, args: tuple, kwargs: dict) -> None:
        key = (self._size, self._call, name)
        self._call += 1
        rows = args[0].size(0)
        if key not in self._graphs:
            buffers = [self._buffer(a, rows) for a in args]
            method = getattr(self.target, name)
            self._fill(buffers, args, rows)
            replay = self.target.capture(lambda: method(*buffers, **kwargs))
            if replay is None:
                raise RuntimeError(f"{self.target.name}.capture returned None after it captured a step")
            self._graphs[key] = (buffers, replay)
        buffers, replay = self._graphs[key]
        self._fill(buffers, args, rows)
        replay()
        self.target.synchronize()
        args[0].copy_(buffers[0][: args[0].size(0)])

    def _buffer(self, value, rows: int):
        """A persistent copy of a per-step tensor argument, its first dimension scaled to the padded size."""
        if not isinstance(value, torch.Tensor) or id(value) in self._persistent:
            return value
        padded = value.size(0) * self._size // rows
        return torch.zeros((padded, *value.shape[1:]), dtype=value.dtype, device=value.device)

    def _fill(self, buffers: list, args: tuple, rows: int) -> None:
        for buffer, value in zip(buffers, args):
            if buffer is not value and isinstance(value, torch.Tensor):
                buffer.zero_()
                buffer[: value.size(0)].copy_(value)


class DecoderEngine:
    def __init__(self, target, checkpoint: Checkpoint, adapters: dict[str, Adapter], dtype: torch.dtype) -> None:
        self.target, self.checkpoint, self.adapters, self.dtype = target, checkpoint, adapters, dtype
        self.decoder = LoRADecoder(checkpoint, dtype, target.device, target)
        self.tokenizer = checkpoint.tokenizer()
        self._stacks: dict[tuple, LoRAStacks] = {}
        self._without_lora: LoRADecoder | None = None
        self._served: dict[int, tuple] = {}  # slots -> (serving target, its eager and graph decoders, persistent stacks)
        self._captures: bool | None = None

    def without_lora(self) -> LoRADecoder:
        """The same decoder, on the same device, with LoRA disabled (:class:`WithoutLoRA`)."""
        if self._without_lora is None:
            self._without_lora = LoRADecoder(self.checkpoint, self.dtype, self.target.device, WithoutLoRA(self.target))
        return self._without_lora

    def graphs_unsupported_reason(self) -> str | None:
        """Why this engine runs no captured graphs (``"eager only: …"``), or ``None``."""
        if self._captures is None:
            self._captures = type(self.target)().capture(lambda: None) is not None
        return None if self._captures else (
            f"eager only: {self.target.name} runs every step eagerly (Target.capture returns None)")

    def _serving(self, slots: tuple[str | None, ...]):
        """A target instance of its own serving the graph runs with ``len(slots)`` slots (built once, with
        ``start_serving``), its decoders (eager prefill, graph decode) and the stacks its graphs read, with
        ``slots``' adapters written in."""
        from conformance.targets.capture import ServingCapacity

        if len(slots) not in self._served:
            max_rank = max((a.max_rank for a in self.adapters.values()), default=1)
            target = type(self.target)()
            target.start_serving(ServingCapacity(max_tokens=512, max_batches=CAPTURE_SIZES[-1], num_slots=len(slots),
                                                 max_rank=max_rank, captured_sizes=CAPTURE_SIZES))
            persistent = LoRAStacks.build((None,) * len(slots), self.checkpoint.config, self.dtype, target.device, max_rank)
            eager = LoRADecoder(self.checkpoint, self.dtype, target.device, target)
            graphs = LoRADecoder(self.checkpoint, self.dtype, target.device, GraphWrapper(target, persistent))
            self._served[len(slots)] = (eager, graphs, persistent, max_rank)
        eager, graphs, persistent, max_rank = self._served[len(slots)]
        adapters = tuple(self.adapters[name] if name else None for name in slots)
        load_in_place(persistent, LoRAStacks.build(adapters, self.checkpoint.config, self.dtype, eager.device, max_rank))
        return eager, graphs, dataclasses.replace(persistent, slots=slots)

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

    def generate(self, requests: list[Request], max_new_tokens: int, top_k: int, max_loras: int, lora: bool = True,
                 graphs: bool = False) -> list[Generation]:
        """Greedy continuations of ``max_new_tokens`` tokens; a token classifier's labels (the argmax at every
        prompt token: nothing is generated, ``max_new_tokens`` is not read). ``lora=False``: with LoRA disabled;
        ``graphs``: the decode steps replayed from captured graphs (module docstring)."""
        if self.is_token_classifier:
            return self._labels(requests, None, top_k, max_loras, lora)
        slots, request_slots = slot_assignment(requests, max_loras)
        stacks = self._stacks_for(slots)
        prefill = decode = self.decoder if lora else self.without_lora()
        if graphs:
            prefill, decode, stacks = self._serving(slots)
        prompts = [self.encode(r.prompt) for r in requests]
        caches = [SequenceCache.empty(self.checkpoint.config.num_hidden_layers) for _ in requests]
        steps: list[list[Step]] = [[] for _ in requests]
        new_tokens = prompts
        for step in range(max_new_tokens):
            sampled = [[len(tokens) - 1] for tokens in new_tokens]
            batch = ForwardBatch(new_tokens, request_slots, caches, sampled, is_prefill=step == 0, num_slots=max_loras)
            logits, routing = (decode if step else prefill).forward(batch, stacks)
            for row, taken in enumerate(steps):
                taken.append(Step.from_logits(logits[row], None, top_k, routing[row]))
            new_tokens = [[taken[-1].token] for taken in steps]
        return [Generation(r, tuple(p), tuple(s)) for r, p, s in zip(requests, prompts, steps)]

    def _labels(self, requests: list[Request], given: list[tuple[int, ...]] | None, top_k: int, max_loras: int,
                lora: bool = True) -> list[Generation]:
        """Every prompt token's label log-probabilities as the steps of a generation: the given label at each
        token (``None``: the argmax)."""
        prompts = [self.encode(r.prompt) for r in requests]
        for prompt, labels in zip(prompts, given or ()):
            if len(labels) != len(prompt):
                raise ValueError(f"{len(labels)} labels given for a prompt of {len(prompt)} tokens (one per token)")
        generations = []
        for i, (request, prompt, logits) in enumerate(zip(requests, prompts, self.classify(requests, max_loras, lora))):
            labels = given[i] if given is not None else [None] * len(prompt)
            steps = tuple(Step.from_logits(row, label, top_k) for row, label in zip(logits, labels))
            generations.append(Generation(request, tuple(prompt), steps))
        return generations

    def classify(self, requests: list[Request], max_loras: int, lora: bool = True) -> list[torch.Tensor]:
        """A token classifier's label logits ``[prompt tokens, labels]`` per request, all prompts in one prefill."""
        slots, request_slots = slot_assignment(requests, max_loras)
        stacks = self._stacks_for(slots)
        prompts = [self.encode(r.prompt) for r in requests]
        caches = [SequenceCache.empty(self.checkpoint.config.num_hidden_layers) for _ in requests]
        decoder = self.decoder if lora else self.without_lora()
        labels = decoder.classify(ForwardBatch(prompts, request_slots, caches, [[] for _ in prompts], True, max_loras), stacks)
        return list(labels.split([len(p) for p in prompts]))

    def score(self, requests: list[Request], continuations: list[tuple[int, ...]], top_k: int, max_loras: int,
              lora: bool = True) -> list[Generation]:
        """Teacher-forced: the log-probabilities of each given continuation, token by token; on a token
        classifier the log-probabilities of the given labels, one per prompt token (``lora=False``: with LoRA
        disabled)."""
        if self.is_token_classifier:
            return self._labels(requests, continuations, top_k, max_loras, lora)
        slots, request_slots = slot_assignment(requests, max_loras)
        stacks = self._stacks_for(slots)
        prompts = [self.encode(r.prompt) for r in requests]
        fed = [p + list(c[:-1]) for p, c in zip(prompts, continuations)]
        sampled = [list(range(len(p) - 1, len(p) - 1 + len(c))) for p, c in zip(prompts, continuations)]
        caches = [SequenceCache.empty(self.checkpoint.config.num_hidden_layers) for _ in requests]
        decoder = self.decoder if lora else self.without_lora()
        logits, routing = decoder.forward(ForwardBatch(fed, request_slots, caches, sampled, True, max_loras), stacks)
        generations, row = [], 0
        for request, prompt, continuation in zip(requests, prompts, continuations):
            steps = tuple(Step.from_logits(logits[row + i], token, top_k, routing[row + i]) for i, token in enumerate(continuation))
            generations.append(Generation(request, tuple(prompt), steps))
            row += len(continuation)
        return generations
