"""The suite's own small decoder: a Llama-style model whose every LoRA delta goes through a target.

The base model is plain PyTorch (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP, or for a
Mixtral a top-k router over SwiGLU experts, or for a Cohere a parallel block: :class:`ParallelBlockConfig`).
The LoRA parts are exactly the calls a vLLM model makes on its PunicaWrapper, so running this decoder on
a target exercises that target's wrapper methods end to end, without vLLM:

* embedding: the layer looks up each token's LoRA-A row (base tokens look up slot 0's row, as vLLM's
  ``embeddings_indices`` do; the target must not apply it), then ``add_lora_embedding``;
* every layer: ``add_lora_linear`` on the packed ``qkv_proj`` (3 slices), ``o_proj``, the packed
  ``gate_up_proj`` (2 slices) and ``down_proj``, with ``scale=1`` (scalings are folded into B);
* a Cohere layer: ``x + attn(h) + mlp(h)`` with ``h = LayerNorm(x)``, and ``add_lora_linear`` on
  ``qkv_gate_up_proj`` (the five projections of ``h`` as 5 slices of widths ``(H, kv, kv, I, I)``, as a
  backend that fuses them would call it), ``o_proj`` and ``down_proj``;
* fp8 experts (``ModelConfig.fp8_experts``): the weights dequantized on load as vLLM's fp8 MoE method does, the
  base expert GEMMs on activations quantized per token, the LoRA calls on the unquantized ones
  (:mod:`conformance.e2e.fp8`);
* a Mixtral layer's experts instead of the MLP: the router (softmax over all experts, the top-k, their
  weights renormalized) in plain torch, each chosen expert's gate/up projection, then
  ``add_lora_w13`` on it (one fused ``2·I`` slice, routing weights not applied), SiLU-and-multiply, the
  down projection times the routing weight, ``add_lora_w2`` on it (routing weight applied), and the
  sum over the choices (docs/moe.md);
* logits: ``add_lora_logits`` over the sampled rows only, with their own slots (a Cohere's lm_head is
  its embedding; its logits are then multiplied by ``logit_scale``);
* a token classifier's label logits (:meth:`LoRADecoder.classify`), as vLLM 0.33's token head layer
  computes them: the base head ``h @ Wᵀ + b`` in plain torch, then every token through the target's
  ``add_shrink`` into a ``[1, T, labels]`` buffer with the slots' saved heads as the stack (rank = labels,
  scale 1), then per token the slot's head output plus its bias where the token has an adapter that
  saved a head, else the base head's.

Numerics: weights, activations and the KV cache are in the run's dtype; norms, rotary embedding, the
attention and router softmaxes and the logits' log-softmax are computed in float32 (float64 for a
float64 run), as vLLM and transformers do; routing weights are float32 (as transformers' and vLLM's
routers give them), also in a float64 run. A batch is packed as vLLM packs it: the new tokens of every sequence, one
after the other, with one LoRA mapping per forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from conformance.reference.mapping import LoRAMapping

from .checkpoint import Checkpoint, layer_shapes
from .fp8 import quantize_per_token
from .lora_stacks import ExpertsSite, LoRAStacks, packed_modules


@dataclass
class SequenceCache:
    """Keys and values of one sequence, per layer: ``[kv_heads, tokens, head_dim]``."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]

    @classmethod
    def empty(cls, num_layers: int) -> SequenceCache:
        return cls([None] * num_layers, [None] * num_layers)

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].size(1)


@dataclass
class ForwardBatch:
    """One forward pass: the new tokens of each sequence, packed, and which rows to take logits of."""

    new_tokens: list[list[int]]  # per sequence
    slots: list[int]  # adapter slot per sequence (−1 = none)
    caches: list[SequenceCache]
    sampled: list[list[int]]  # per sequence: indices into its new tokens whose logits are wanted
    is_prefill: bool
    num_slots: int
    positions: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.positions = [cache.length for cache in self.caches]

    def mapping(self) -> LoRAMapping:
        token_slots = tuple(slot for tokens, slot in zip(self.new_tokens, self.slots) for _ in tokens)
        sampled_slots = tuple(slot for rows, slot in zip(self.sampled, self.slots) for _ in rows)
        seq_lens = tuple(len(tokens) for tokens in self.new_tokens)
        return LoRAMapping(token_slots, sampled_slots, seq_lens, self.is_prefill, self.num_slots)

    def sampled_rows(self) -> list[int]:
        rows, start = [], 0
        for tokens, wanted in zip(self.new_tokens, self.sampled):
            rows.extend(start + i for i in wanted)
            start += len(tokens)
        return rows


class LoRADecoder:
    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, wrapper) -> None:
        self.config = config = checkpoint.config
        self.dtype, self.device, self.wrapper = dtype, device, wrapper
        self.quantize_activations = True  # fp8 experts: the base GEMMs read fp8 activations (base_input)
        self.compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        w = {name: t.to(device=device, dtype=dtype) for name, t in checkpoint.weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight")  # a Cohere's is its embedding (tied on load); none on a token classifier
        self.score, self.score_bias = w.get("score.weight"), w.get("score.bias")  # a token classifier's head
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            # the linear modules by short name (q_proj, …, down_proj; a Mixtral's router is "gate")
            weight = {name.split(".")[-2]: w[p + name] for name, shape in layer_shapes(config).items() if len(shape) == 2}
            layer = {
                "input_norm": w[p + "input_layernorm.weight"],
                # packed like vLLM's QKVParallelLinear / MergedColumnParallelLinear
                **{packed: torch.cat([weight[m] for m in parts]) for packed, parts in packed_modules(config).items()},
            }
            if config.parallel is None:
                layer["post_attention_norm"] = w[p + "post_attention_layernorm.weight"]
            if config.experts is not None:
                layer |= {"router": weight["gate"], "experts.gate_up_proj": w[p + "mlp.experts.gate_up_proj"],
                          "experts.down_proj": w[p + "mlp.experts.down_proj"]}
            self.layers.append(layer)
        head_dim = config.head_dim
        exponent = torch.arange(0, head_dim, 2, dtype=self.compute_dtype) / head_dim
        self.inv_freq = (1.0 / config.rope_theta**exponent).to(device)

    # -- the pieces ----------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm ``x / √(mean(x²) + ε) · w``, rounded to the run's dtype before the weight (transformers'
        Llama and Mixtral); a Cohere's LayerNorm without bias ``(x − mean(x)) / √(var(x) + ε) · w``, the
        weight applied before rounding (transformers' and vLLM's Cohere)."""
        x32 = x.to(self.compute_dtype)
        layer_norm = self.config.parallel is not None
        if layer_norm:
            x32 = x32 - x32.mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        if layer_norm:
            return (weight.to(self.compute_dtype) * x32).to(self.dtype)
        return weight * x32.to(self.dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[heads, tokens, head_dim]``: the pair of dimensions ``(a, b)`` at frequency
        ``i`` becomes ``(a cos − b sin, b cos + a sin)`` of ``position · θ^(−2i/d)``. HF Llama pairs ``(i, i + d/2)``
        (half split, vLLM's neox style); a Cohere pairs ``(2i, 2i + 1)`` (interleaved, vLLM's ``is_neox_style=False``)."""
        angles = positions.to(self.compute_dtype)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        x32 = x.to(self.compute_dtype)
        interleaved = self.config.parallel is not None
        a, b = x32.unflatten(-1, (-1, 2)).unbind(-1) if interleaved else x32.chunk(2, -1)
        turned = (a * cos - b * sin, b * cos + a * sin)
        return (torch.stack(turned, -1).flatten(-2) if interleaved else torch.cat(turned, -1)).to(self.dtype)

    def attention(self, q, k, v, cache: SequenceCache, layer: int, start: int) -> torch.Tensor:
        """Causal attention of one sequence's new tokens over its cache; returns ``[tokens, hidden]``."""
        c = self.config
        n = q.size(0)
        positions = torch.arange(start, start + n, device=self.device)
        q = self.rotate(q.view(n, c.num_attention_heads, c.head_dim).transpose(0, 1), positions)
        k = self.rotate(k.view(n, c.num_key_value_heads, c.head_dim).transpose(0, 1), positions)
        v = v.view(n, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        if cache.keys[layer] is not None:
            k, v = torch.cat([cache.keys[layer], k], 1), torch.cat([cache.values[layer], v], 1)
        cache.keys[layer], cache.values[layer] = k, v
        group = c.num_attention_heads // c.num_key_value_heads
        k32 = k.repeat_interleave(group, 0).to(self.compute_dtype)
        v32 = v.repeat_interleave(group, 0).to(self.compute_dtype)
        scores = q.to(self.compute_dtype) @ k32.transpose(1, 2) / math.sqrt(c.head_dim)
        key_positions = torch.arange(k.size(1), device=self.device)
        scores = scores.masked_fill(key_positions[None, :] > positions[:, None], float("-inf"))
        out = torch.softmax(scores, -1) @ v32  # [heads, tokens, head_dim]
        return out.transpose(0, 1).reshape(n, c.hidden_size).to(self.dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, stacks: LoRAStacks, layer: int, module: str) -> torch.Tensor:
        """``x @ Wᵀ`` plus the LoRA delta of every sequence's adapter, added by the target."""
        y = x @ weight.T
        site = stacks.layers[layer][module]
        self.wrapper.add_lora_linear(y, x, site.lora_a, site.lora_b, 1.0, site.output_slices)
        return y

    def projections(self, x: torch.Tensor, layer: dict, stacks: LoRAStacks, index: int, packed: str) -> tuple[torch.Tensor, ...]:
        """A packed module's output (one ``add_lora_linear`` call), split into its sub-modules' outputs."""
        widths = list(stacks.layers[index][packed].output_slices)
        return self.linear(x, layer[packed], stacks, index, packed).split(widths, -1)

    def self_attention(self, q, k, v, batch: ForwardBatch, layer: dict, stacks: LoRAStacks, index: int) -> torch.Tensor:
        """Each sequence's attention over its own cache, then ``o_proj`` over the whole batch."""
        outputs, start = [], 0
        for seq, (new, cache) in enumerate(zip(batch.new_tokens, batch.caches)):
            rows = slice(start, start + len(new))
            outputs.append(self.attention(q[rows], k[rows], v[rows], cache, index, batch.positions[seq]))
            start += len(new)
        return self.linear(torch.cat(outputs), layer["o_proj"], stacks, index, "o_proj")

    def mlp(self, x: torch.Tensor, layer: dict, stacks: LoRAStacks, index: int, routing: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP (packed gate/up, then down), or a Mixtral's experts (which lower ``routing``)."""
        if self.config.experts is not None:
            return self.experts(x, layer, stacks.experts[index], routing)
        gate, up = self.projections(x, layer, stacks, index, "gate_up_proj")
        return self.down(gate, up, layer, stacks, index)

    def down(self, gate: torch.Tensor, up: torch.Tensor, layer: dict, stacks: LoRAStacks, index: int) -> torch.Tensor:
        """SwiGLU's second half: ``down_proj(silu(gate) · up)``."""
        return self.linear(torch.nn.functional.silu(gate) * up, layer["down_proj"], stacks, index, "down_proj")

    def experts(self, x: torch.Tensor, layer: dict, site: ExpertsSite, routing: torch.Tensor) -> torch.Tensor:
        """The MoE MLP of ``x`` ``[T, hidden]``: each token's top-k experts, their LoRA deltas added by the target.

        ``routing`` (per token) is lowered to the gap between the k-th and (k+1)-th router logits.
        """
        c, compute = self.config.experts, self.compute_dtype
        router_logits = (x @ layer["router"].T).to(compute)
        if c.top_k < c.num_experts:
            ranked = router_logits.topk(c.top_k + 1, -1).values
            torch.minimum(routing, ranked[:, -2] - ranked[:, -1], out=routing)
        weights, ids = torch.softmax(router_logits, -1).topk(c.top_k, -1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        topk_ids, topk_weights = ids.to(torch.int32), weights.to(torch.float32)
        # the base experts, one product per (token, choice): gate/up [T, top_k, 2·I]; fp8 experts multiply fp8
        # activations, and LoRA reads them unquantized (conformance.e2e.fp8)
        gate_up = (layer["experts.gate_up_proj"][ids] @ self.base_input(x)[:, None, :, None]).squeeze(-1)
        self.wrapper.add_lora_w13(gate_up, x, site.w13_lora_a, site.w13_lora_b, topk_ids, topk_weights, site.adapter_enabled)
        gate, up = gate_up.chunk(2, -1)
        activated = torch.nn.functional.silu(gate) * up  # [T, top_k, I]; row t·top_k + k of the w2 input
        down = (layer["experts.down_proj"][ids] @ self.base_input(activated)[..., None]).squeeze(-1)  # [T, top_k, hidden]
        down = (down.to(compute) * topk_weights.to(compute)[..., None]).to(self.dtype)
        self.wrapper.add_lora_w2(down, activated.reshape(-1, activated.size(-1)), site.w2_lora_a, site.w2_lora_b,
                                 topk_ids, topk_weights, site.adapter_enabled)
        return down.sum(1)

    def base_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the base experts multiply: ``x`` itself, or for fp8 experts ``x`` quantized per row (vLLM's
        dynamic per-token fp8 activations), unless ``quantize_activations`` is off (the PEFT oracle's comparison)."""
        if not (self.config.fp8_experts and self.quantize_activations):
            return x
        return quantize_per_token(x, self.compute_dtype)

    # -- one forward pass ----------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, stacks: LoRAStacks) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[sampled rows, vocab]`` (compute dtype) of the batch's sampled rows, and each sampled
        row's routing margin (compute dtype; inf without experts: see :class:`conformance.e2e.generation.Step`)."""
        x, routing = self.hidden_states(batch, stacks)
        c = self.config
        sampled = batch.sampled_rows()
        h = self.norm(x, self.final_norm)[sampled]
        logits = h @ self.lm_head.T
        head = stacks.lm_head
        self.wrapper.add_lora_logits(logits, h, head.lora_a[0], head.lora_b[0], 1.0)
        if c.parallel is not None:  # outside the lm_head, so after its LoRA (transformers' and vLLM's order)
            logits = logits * c.parallel.logit_scale
        self.wrapper.synchronize()
        return logits.to("cpu", self.compute_dtype), routing[sampled].cpu()

    def classify(self, batch: ForwardBatch, stacks: LoRAStacks) -> torch.Tensor:
        """A token classifier's label logits ``[tokens, labels]`` (compute dtype) of every token of the batch.

        The saved heads go through the target's ``add_shrink`` as one stack, into a buffer in the compute
        dtype (float32, as vLLM's layer allocates it; float64 for the float64 reference); each token then takes
        its slot's head output plus bias if its adapter saved a head, else the base head's output.
        """
        x, _ = self.hidden_states(batch, stacks)
        h = self.norm(x, self.final_norm)
        base = h @ self.score.T + self.score_bias
        head = stacks.head
        adapter_output = torch.zeros(1, h.size(0), head.weight.size(2), dtype=self.compute_dtype, device=self.device)
        self.wrapper.add_shrink(adapter_output, h, (head.weight,), 1.0)
        slots = torch.tensor([s for seq, s in zip(batch.new_tokens, batch.slots) for _ in seq], device=self.device)
        own_head = (slots >= 0) & head.enabled[slots.clamp(min=0)]
        labels = torch.where(own_head[:, None], adapter_output[0] + head.bias[slots.clamp(min=0)], base.to(self.compute_dtype))
        self.wrapper.synchronize()
        return labels.to("cpu", self.compute_dtype)

    def hidden_states(self, batch: ForwardBatch, stacks: LoRAStacks) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output ``[tokens, hidden]`` (before the final norm) of every token, and each token's
        routing margin (inf without experts)."""
        self.wrapper.update_metadata(batch.mapping())
        c = self.config
        tokens = torch.tensor([t for seq in batch.new_tokens for t in seq], dtype=torch.long, device=self.device)
        slots = torch.tensor([s for seq, s in zip(batch.new_tokens, batch.slots) for _ in seq], device=self.device)
        x = self.embed[tokens]
        lookup = slots.clamp(min=0) * c.vocab_size + tokens  # base tokens read slot 0's row, like vLLM
        lora_a_rows = stacks.embedding_a.reshape(-1, stacks.max_rank)[lookup]
        self.wrapper.add_lora_embedding(x, lora_a_rows, stacks.embedding_b, add_inputs=True)
        routing = torch.full((len(tokens),), math.inf, dtype=self.compute_dtype, device=self.device)  # no float64 on HPU
        for index, layer in enumerate(self.layers):
            h = self.norm(x, layer["input_norm"])
            if c.parallel is None:
                q, k, v = self.projections(h, layer, stacks, index, "qkv_proj")
                x = x + self.self_attention(q, k, v, batch, layer, stacks, index)
                x = x + self.mlp(self.norm(x, layer["post_attention_norm"]), layer, stacks, index, routing)
            else:  # one call for the five projections of h; summed in transformers' order, (x + attn) + mlp
                q, k, v, gate, up = self.projections(h, layer, stacks, index, "qkv_gate_up_proj")
                x = x + self.self_attention(q, k, v, batch, layer, stacks, index) + self.down(gate, up, layer, stacks, index)
        return x, routing
