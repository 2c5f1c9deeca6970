"""PEFT-format LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter contributes, for every module it targets, ``ΔW = scaling · B @ A`` with
``scaling = lora_alpha / r`` (``lora_alpha / √r`` under rsLoRA). For the embedding, PEFT stores
``lora_embedding_A`` as ``[r, vocab]`` and ``lora_embedding_B`` as ``[hidden, r]``, and the delta of
token ``v`` is ``scaling · B @ A[:, v]``.

On a Mixtral model an adapter may also name the fused expert parameters in ``target_parameters``
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``): each expert ``e``
gets ``ΔW_e = scaling · B_e @ A_e``. PEFT 0.21's ``ParamWrapper`` saves all experts in one pair,
``lora_A.weight`` ``[E·r, in]`` (row ``e·r + j`` = ``A_e[j]``) and ``lora_B.weight`` ``[out, r·E]``
(column ``j·E + e`` = ``B_e[:, j]``), and nests one wrapper per targeted parameter on the ``experts``
module in the module's parameter order: with both targeted, gate_up_proj's pair is under
``experts.base_layer.`` and down_proj's under ``experts.``.

What the suite cannot express (DoRA, per-module rank or alpha patterns, bias training, modules_to_save)
is refused with a message naming the field, never ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import ModelConfig, expert_shape, linear_shape, read_json, read_safetensors

# The modules a LoRA adapter may target, by PEFT's target_modules name.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_MODULES = ATTENTION_MODULES + ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = frozenset(LINEAR_MODULES + ("embed_tokens", "lm_head"))
MOE_SUPPORTED_MODULES = frozenset(ATTENTION_MODULES + ("embed_tokens", "lm_head"))  # a Mixtral has no dense MLP
# The fused expert parameters, in the experts module's parameter order (PEFT's nesting order).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")

_EXPERT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])\.weight$")
_LAYER_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_EMBED_KEY = re.compile(r"^base_model\.model\.model\.embed_tokens\.lora_embedding_([AB])$")
_HEAD_KEY = re.compile(r"^base_model\.model\.lm_head\.lora_([AB])\.weight$")
# PEFT also saves the base embedding / lm_head weights when an adapter targets them (save_embedding_layers)
_BASE_KEY = re.compile(r"^base_model\.model\.((?:model\.embed_tokens|lm_head)\.)base_layer\.(weight)$")

# Fields whose non-default value changes the math in a way the suite does not model.
_REFUSED = {
    "use_dora": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "modules_to_save": (None, []),
    "bias": ("none",),
    "fan_in_fan_out": (False, None),
}


@dataclass(frozen=True)
class ModuleDelta:
    """One targeted module's LoRA pair: ``A`` is ``[r, in]``, ``B`` is ``[out, r]``; for a fused expert
    parameter (module ``experts.gate_up_proj`` or ``experts.down_proj``) ``[E, r, in]`` and ``[E, out, r]``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]  # PEFT's target_modules, and "experts.<parameter>" per target parameter
    # key: (layer or None, module name), e.g. (0, "q_proj"), (None, "embed_tokens"), (None, "lm_head"),
    # (1, "experts.down_proj")
    deltas: dict[tuple[int | None, str], ModuleDelta]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def delta(self, layer: int | None, module: str) -> ModuleDelta | None:
        return self.deltas.get((layer, module))

    @classmethod
    def load(cls, path: str | Path, model: ModelConfig, base_weights: dict | None = None, name: str | None = None) -> Adapter:
        """Read a PEFT adapter directory; ``base_weights`` (the model's) lets saved base layers be checked."""
        path = Path(path)
        config_path = path / "adapter_config.json"
        raw = read_json(config_path, "a PEFT adapter directory holds adapter_config.json")
        rank, alpha, rslora, modules = _parse_config(raw, config_path, model)
        parameters = _parse_target_parameters(raw, config_path, model)
        weights_path = path / "adapter_model.safetensors"
        if not weights_path.is_file() and (path / "adapter_model.bin").is_file():
            raise ValueError(f"{path}: only adapter_model.safetensors is read (pickled .bin weights are refused)")
        tensors = read_safetensors(weights_path)
        deltas = _parse_expert_weights(tensors, weights_path, rank, parameters, model)
        deltas.update(_parse_weights(tensors, weights_path, rank, modules, model, base_weights or {}))
        return cls(name or path.name, path, rank, alpha, rslora, modules | {f"experts.{p}" for p in parameters}, deltas)


def _parse_config(raw: dict, where: Path, model: ModelConfig) -> tuple[int, float, bool, frozenset[str]]:
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{where}: field 'peft_type' must be 'LORA', got {raw.get('peft_type')!r}")
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in raw:
            raise ValueError(f"{where}: missing field {field!r}")
    rank, alpha = raw["r"], raw["lora_alpha"]
    if not (isinstance(rank, int) and rank > 0):
        raise ValueError(f"{where}: field 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: field 'lora_alpha' must be a number, got {alpha!r}")
    for field, allowed in _REFUSED.items():
        if field in raw and raw[field] not in allowed:
            raise ValueError(f"{where}: field {field!r} = {raw[field]!r} is not supported by the suite (allowed: {allowed})")
    modules = raw["target_modules"]
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"{where}: field 'target_modules' must be a list of module names, got {modules!r}")
    supported = SUPPORTED_MODULES if model.experts is None else MOE_SUPPORTED_MODULES
    unknown = sorted(set(modules) - supported)
    if unknown:
        raise ValueError(f"{where}: field 'target_modules' names {unknown}; supported: {sorted(supported)}")
    return rank, float(alpha), bool(raw.get("use_rslora", False)), frozenset(modules)


def _parse_target_parameters(raw: dict, where: Path, model: ModelConfig) -> tuple[str, ...]:
    """The fused expert parameters the adapter targets, in nesting order (``EXPERT_PARAMETERS``).

    PEFT matches an entry against ``model.layers.<n>.mlp.experts.<parameter>`` by dotted suffix, so
    ``gate_up_proj``, ``experts.gate_up_proj`` and ``mlp.experts.gate_up_proj`` all name every layer's.
    """
    entries = raw.get("target_parameters") or []
    if not entries:
        return ()
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise ValueError(f"{where}: field 'target_parameters' must be a list of parameter names, got {entries!r}")
    if model.experts is None:
        raise ValueError(f"{where}: field 'target_parameters' = {entries!r}, but the model has no experts (a dense Llama)")
    named = {}
    for entry in entries:
        parameter = next((p for p in EXPERT_PARAMETERS if f".mlp.experts.{p}".endswith("." + entry)), None)
        if parameter is None:
            expected = [f"mlp.experts.{p}" for p in EXPERT_PARAMETERS]
            raise ValueError(f"{where}: field 'target_parameters' names {entry!r}; supported: {expected} (every layer's)")
        named[parameter] = entry
    return tuple(p for p in EXPERT_PARAMETERS if p in named)


def _parse_expert_weights(tensors: dict, where: Path, rank: int, parameters: tuple[str, ...], model: ModelConfig) -> dict:
    """Pop the fused expert LoRA pairs out of ``tensors`` and unpack them per expert."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in [k for k in tensors if _EXPERT_KEY.match(k)]:
        layer, nesting, half = _EXPERT_KEY.match(key).groups()
        depth = nesting.count("base_layer.")
        if depth >= len(parameters):
            raise ValueError(f"{where}: tensor {key!r} is an expert LoRA weight, but target_parameters names "
                             f"{len(parameters)} expert parameter(s): {list(parameters)}")
        if not 0 <= int(layer) < model.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} names layer {layer}, the model has {model.num_hidden_layers}")
        parameter = parameters[len(parameters) - 1 - depth]  # the innermost wrapper is the first parameter
        halves.setdefault((int(layer), parameter), {})[half] = tensors.pop(key)
    deltas = {}
    for layer in range(model.num_hidden_layers):
        for parameter in parameters:
            pair = halves.get((layer, parameter), {})
            if set(pair) != {"A", "B"}:
                have = f"lora_{''.join(sorted(pair))}" if pair else "no tensors"
                raise ValueError(f"{where}: expert parameter {parameter!r} (layer {layer}) has {have}, not both lora_A and lora_B")
            experts, out_features, in_features = expert_shape(model, parameter)
            a, b = pair["A"], pair["B"]
            _check_shapes(where, f"expert parameter {parameter!r} (layer {layer})", a, b, (experts * rank, in_features),
                          (out_features, rank * experts), f"r={rank} and {experts} experts")
            # A: expert-major rows; B: rank-major columns (PEFT reshapes it to [out, r, E])
            deltas[(layer, f"experts.{parameter}")] = ModuleDelta(
                a.reshape(experts, rank, in_features), b.reshape(out_features, rank, experts).permute(2, 0, 1)
            )
    return deltas


def _parse_weights(tensors, where: Path, rank: int, modules: frozenset[str], model: ModelConfig, base_weights: dict):
    halves: dict[tuple[int | None, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if match := _BASE_KEY.match(key):
            base_name = "".join(match.groups())
            if base_name in base_weights and not torch.equal(base_weights[base_name], tensor.to(base_weights[base_name].dtype)):
                raise ValueError(f"{where}: tensor {key!r} replaces the base model's {base_name} (not supported: LoRA only)")
            continue
        if match := _LAYER_KEY.match(key):
            layer, _, module, half = match.groups()
            slot_key = (int(layer), module)
        elif match := _EMBED_KEY.match(key):
            slot_key, half = (None, "embed_tokens"), match.group(1)
        elif match := _HEAD_KEY.match(key):
            slot_key, half = (None, "lm_head"), match.group(1)
        else:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of a supported module")
        if slot_key[1] not in modules:
            raise ValueError(f"{where}: tensor {key!r} belongs to {slot_key[1]!r}, which target_modules does not list")
        if slot_key[0] is not None and not 0 <= slot_key[0] < model.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} names layer {slot_key[0]}, the model has {model.num_hidden_layers}")
        halves.setdefault(slot_key, {})[half] = tensor
    deltas = {}
    for (layer, module), pair in sorted(halves.items(), key=lambda item: (item[0][0] or -1, item[0][1])):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: module {module!r} (layer {layer}) has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        if module == "embed_tokens":  # PEFT: A [r, vocab], B [hidden, r]
            expected_a, expected_b = (rank, model.vocab_size), (model.hidden_size, rank)
        else:
            out_features, in_features = linear_shape(model, module)
            expected_a, expected_b = (rank, in_features), (out_features, rank)
        _check_shapes(where, f"module {module!r} (layer {layer})", a, b, expected_a, expected_b, f"r={rank} and the model")
        deltas[(layer, module)] = ModuleDelta(a, b)
    return deltas


def _check_shapes(where: Path, what: str, a: torch.Tensor, b: torch.Tensor, expected_a: tuple, expected_b: tuple, implied_by: str) -> None:
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise ValueError(f"{where}: {what} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                         f"{implied_by} imply A {expected_a} and B {expected_b}")
