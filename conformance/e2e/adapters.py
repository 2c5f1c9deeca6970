"""PEFT-format LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter contributes, for every module it targets, ``ΔW = scaling · B @ A`` with
``scaling = lora_alpha / r`` (``lora_alpha / √r`` under rsLoRA). For the embedding, PEFT stores
``lora_embedding_A`` as ``[r, vocab]`` and ``lora_embedding_B`` as ``[hidden, r]``, and the delta of
token ``v`` is ``scaling · B @ A[:, v]``.

What the suite cannot express (DoRA, per-module rank or alpha patterns, bias training, modules_to_save)
is refused with a message naming the field, never ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import ModelConfig, linear_shape, read_json, read_safetensors

# The modules a LoRA adapter may target, by PEFT's target_modules name.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = frozenset(LINEAR_MODULES + ("embed_tokens", "lm_head"))

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
    """One targeted module's LoRA pair: ``A`` is ``[r, in]``, ``B`` is ``[out, r]``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    # key: (layer or None, module name), e.g. (0, "q_proj"), (None, "embed_tokens"), (None, "lm_head")
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
        rank, alpha, rslora, modules = _parse_config(raw, config_path)
        weights_path = path / "adapter_model.safetensors"
        if not weights_path.is_file() and (path / "adapter_model.bin").is_file():
            raise ValueError(f"{path}: only adapter_model.safetensors is read (pickled .bin weights are refused)")
        deltas = _parse_weights(read_safetensors(weights_path), weights_path, rank, modules, model, base_weights or {})
        return cls(name or path.name, path, rank, alpha, rslora, modules, deltas)


def _parse_config(raw: dict, where: Path) -> tuple[int, float, bool, frozenset[str]]:
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
    unknown = sorted(set(modules) - SUPPORTED_MODULES)
    if unknown:
        raise ValueError(f"{where}: field 'target_modules' names {unknown}; supported: {sorted(SUPPORTED_MODULES)}")
    return rank, float(alpha), bool(raw.get("use_rslora", False)), frozenset(modules)


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
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise ValueError(
                f"{where}: module {module!r} (layer {layer}) has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"r={rank} and the model imply A {expected_a} and B {expected_b}"
            )
        deltas[(layer, module)] = ModuleDelta(a, b)
    return deltas

