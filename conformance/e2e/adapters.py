r"""PEFT-format LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

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

Per-module ranks and alphas (PEFT's ``rank_pattern`` / ``alpha_pattern``): each module's rank and alpha
are those of the first pattern key, in the file's order, that matches the module's name as a whole or
as a suffix starting after a dot (the regular expression ``(.*\.)?(KEY)$``), else ``r`` and
``lora_alpha``; its scaling is ``alpha_m / r_m`` (``alpha_m / √r_m`` under rsLoRA), from the module's own
rank. The name is the module's path in the model, as the checkpoint's tensor names spell it after
``base_model.model.`` (``model.layers.0.self_attn.q_proj``, ``model.embed_tokens``, ``lm_head``; an expert
parameter ``model.layers.0.mlp.experts.gate_up_proj``). That is PEFT's rule when it builds the layers
(``get_pattern_key``) and vLLM's when it loads them (``PEFTHelper.get_rank_and_scaling``; docs/e2e.md).

On a token classifier (``LlamaForTokenClassification``) an adapter may save a whole head of its own:
``modules_to_save`` lists ``score`` (PEFT's token-classification task lists ``classifier`` and ``score``),
and the file holds ``base_model.model.score.weight`` ``[num_labels, hidden]`` and ``….score.bias``; its
tokens' label logits are then ``x @ Wᵀ + b`` of that head instead of the base head's (``SavedHead``).
An adapter that saved no head leaves its tokens the base head.

What the suite cannot express (DoRA, bias training, other modules to save) is refused with a message
naming the field, never ignored.
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
# A saved head (modules_to_save) of a token classifier: the whole layer, PEFT's wrapper names stripped
_HEAD_SAVED_KEY = re.compile(r"^base_model\.model\.(score|classifier)\.(weight|bias)$")
# The modules a token classifier's adapter may save (vLLM's PEFTHelper accepts exactly these)
SAVABLE_HEADS = frozenset({"classifier", "score"})

# Fields whose non-default value changes the math in a way the suite does not model.
_REFUSED = {
    "use_dora": (False, None),
    "bias": ("none",),
    "fan_in_fan_out": (False, None),
}


@dataclass(frozen=True)
class ModuleDelta:
    """One targeted module's LoRA pair: ``A`` is ``[r, in]``, ``B`` is ``[out, r]``; for a fused expert
    parameter (module ``experts.gate_up_proj`` or ``experts.down_proj``) ``[E, r, in]`` and ``[E, out, r]``.
    ``r`` and ``scaling`` are the module's own (``RankRule.of``): its delta is ``scaling · B @ A``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.size(-2)


def _pattern_value(pattern: tuple[tuple[str, float], ...], module_name: str):
    """The value of the first key (in the adapter file's order) that names ``module_name`` whole or as a
    dotted suffix, else ``None``: PEFT's and vLLM's rule, keys being regular expressions."""
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return None


@dataclass(frozen=True)
class RankRule:
    """An adapter's ``r`` and ``lora_alpha``, their per-module overrides, and the scaling they give a module."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...] = ()  # (key, rank), in the file's order
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @staticmethod
    def scaling_of(rank: int, alpha: float, use_rslora: bool) -> float:
        return alpha / (math.sqrt(rank) if use_rslora else rank)

    def of(self, module_name: str) -> tuple[int, float]:
        """``(rank, scaling)`` of the module at ``module_name`` (e.g. ``model.layers.1.mlp.down_proj``):
        the rsLoRA square root is taken of the module's own rank."""
        rank = _pattern_value(self.rank_pattern, module_name)
        alpha = _pattern_value(self.alpha_pattern, module_name)
        rank = self.r if rank is None else rank
        return rank, self.scaling_of(rank, self.lora_alpha if alpha is None else alpha, self.use_rslora)

    @property
    def max_rank(self) -> int:
        """The largest rank any module may have: what vLLM checks against ``max_lora_rank``."""
        return max([self.r, *(rank for _, rank in self.rank_pattern)])


@dataclass(frozen=True)
class SavedHead:
    """A token classifier's head saved whole by an adapter: ``weight`` ``[num_labels, hidden]``, ``bias`` ``[num_labels]``."""

    weight: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int  # PEFT's r: the rank of every module no rank_pattern key names
    alpha: float  # PEFT's lora_alpha, likewise
    use_rslora: bool
    target_modules: frozenset[str]  # PEFT's target_modules, and "experts.<parameter>" per target parameter
    # key: (layer or None, module name), e.g. (0, "q_proj"), (None, "embed_tokens"), (None, "lm_head"),
    # (1, "experts.down_proj"); each with its own rank and scaling
    deltas: dict[tuple[int | None, str], ModuleDelta]
    rule: RankRule  # r, lora_alpha and rsLoRA with the per-module patterns
    head: SavedHead | None = None  # a token classifier's own head (modules_to_save), else the base head

    @property
    def scaling(self) -> float:
        """The scaling of a module no pattern names (``ModuleDelta.scaling`` is each module's own)."""
        return RankRule.scaling_of(self.rank, self.alpha, self.use_rslora)

    @property
    def max_rank(self) -> int:
        """The largest module rank the adapter may have (``r`` and every ``rank_pattern`` value)."""
        return self.rule.max_rank

    def delta(self, layer: int | None, module: str) -> ModuleDelta | None:
        return self.deltas.get((layer, module))

    @classmethod
    def load(cls, path: str | Path, model: ModelConfig, base_weights: dict | None = None, name: str | None = None) -> Adapter:
        """Read a PEFT adapter directory; ``base_weights`` (the model's) lets saved base layers be checked."""
        path = Path(path)
        config_path = path / "adapter_config.json"
        raw = read_json(config_path, "a PEFT adapter directory holds adapter_config.json")
        rule, modules = _parse_config(raw, config_path, model)
        parameters = _parse_target_parameters(raw, config_path, model)
        weights_path = path / "adapter_model.safetensors"
        if not weights_path.is_file() and (path / "adapter_model.bin").is_file():
            raise ValueError(f"{path}: only adapter_model.safetensors is read (pickled .bin weights are refused)")
        tensors = read_safetensors(weights_path)
        head = _parse_saved_head(raw, tensors, config_path, weights_path, model)
        deltas = _parse_expert_weights(tensors, weights_path, rule, parameters, model)
        deltas.update(_parse_weights(tensors, weights_path, rule, modules, model, base_weights or {}))
        targets = modules | {f"experts.{p}" for p in parameters}
        return cls(name or path.name, path, rule.r, rule.lora_alpha, rule.use_rslora, targets, deltas, rule, head)


def _parse_config(raw: dict, where: Path, model: ModelConfig) -> tuple[RankRule, frozenset[str]]:
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
    rank_pattern = _parse_pattern(raw, "rank_pattern", where, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                                  "a positive integer")
    alpha_pattern = _parse_pattern(raw, "alpha_pattern", where, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                                   "a number")
    rule = RankRule(rank, float(alpha), bool(raw.get("use_rslora", False)), rank_pattern,
                    tuple((key, float(value)) for key, value in alpha_pattern))
    return rule, frozenset(modules)


def _parse_pattern(raw: dict, field: str, where: Path, valid, what: str) -> tuple[tuple[str, float], ...]:
    """A ``rank_pattern`` / ``alpha_pattern`` as ``(key, value)`` pairs in the file's order (first match wins)."""
    pattern = raw.get(field) or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{where}: field {field!r} must be a mapping of module name patterns, got {pattern!r}")
    for key, value in pattern.items():
        if not valid(value):
            raise ValueError(f"{where}: field {field!r} maps {key!r} to {value!r}; each value must be {what}")
        try:
            re.compile(key)
        except re.error as exc:
            raise ValueError(f"{where}: field {field!r} has key {key!r}, not a regular expression ({exc})") from None
    return tuple(pattern.items())


def _parse_saved_head(raw: dict, tensors: dict, where: Path, weights_path: Path, model: ModelConfig) -> SavedHead | None:
    """Pop a saved token-classification head out of ``tensors``: ``None`` when the adapter saved none."""
    listed = raw.get("modules_to_save") or []
    if isinstance(listed, str) or not all(isinstance(m, str) for m in listed):
        raise ValueError(f"{where}: field 'modules_to_save' must be a list of module names, got {listed!r}")
    if listed and model.num_labels is None:
        raise ValueError(f"{where}: field 'modules_to_save' = {listed!r} is supported only on a token classifier "
                         f"(a head saved whole); this model is a causal LM")
    if set(listed) - SAVABLE_HEADS:
        raise ValueError(f"{where}: field 'modules_to_save' names {sorted(set(listed) - SAVABLE_HEADS)}; "
                         f"only the classification head may be saved: {sorted(SAVABLE_HEADS)}")
    saved: dict[str, torch.Tensor] = {}
    for key in [k for k in tensors if _HEAD_SAVED_KEY.match(k)]:
        module, part = _HEAD_SAVED_KEY.match(key).groups()
        if module not in listed:
            raise ValueError(f"{weights_path}: tensor {key!r} saves {module!r}, which modules_to_save does not list")
        if module != "score":
            raise ValueError(f"{weights_path}: tensor {key!r} saves {module!r}; the model's head is 'score'")
        saved[part] = tensors.pop(key)
    if not saved:
        return None  # listed but not saved: PEFT and vLLM use the base head
    if "weight" not in saved:
        raise ValueError(f"{weights_path}: the saved head has a bias but no 'base_model.model.score.weight'")
    bias = saved.get("bias", torch.zeros(model.num_labels, dtype=saved["weight"].dtype))
    expected = ((model.num_labels, model.hidden_size), (model.num_labels,))
    if (tuple(saved["weight"].shape), tuple(bias.shape)) != expected:
        raise ValueError(f"{weights_path}: the saved head has weight {tuple(saved['weight'].shape)} and bias "
                         f"{tuple(bias.shape)}; the model's {model.num_labels} labels imply {expected[0]} and {expected[1]}")
    return SavedHead(saved["weight"], bias)


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


def _parse_expert_weights(tensors: dict, where: Path, rule: RankRule, parameters: tuple[str, ...], model: ModelConfig) -> dict:
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
            # patterns name a fused parameter by its path (vLLM maps PEFT's nested wrappers back to it)
            rank, scaling = rule.of(f"model.layers.{layer}.mlp.experts.{parameter}")
            a, b = pair["A"], pair["B"]
            _check_shapes(where, f"expert parameter {parameter!r} (layer {layer})", a, b, (experts * rank, in_features),
                          (out_features, rank * experts), f"r={rank} and {experts} experts")
            # A: expert-major rows; B: rank-major columns (PEFT reshapes it to [out, r, E])
            deltas[(layer, f"experts.{parameter}")] = ModuleDelta(
                a.reshape(experts, rank, in_features), b.reshape(out_features, rank, experts).permute(2, 0, 1), scaling
            )
    return deltas


def _parse_weights(tensors, where: Path, rule: RankRule, modules: frozenset[str], model: ModelConfig, base_weights: dict):
    halves: dict[tuple[int | None, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int | None, str], str] = {}  # the module's path in the model, which patterns match
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
        # the tensor's name without PEFT's prefix and the LoRA suffix, as vLLM resolves patterns
        paths[slot_key] = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    deltas = {}
    for (layer, module), pair in sorted(halves.items(), key=lambda item: (item[0][0] or -1, item[0][1])):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: module {module!r} (layer {layer}) has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        rank, scaling = rule.of(paths[(layer, module)])
        if module == "embed_tokens":  # PEFT: A [r, vocab], B [hidden, r]
            expected_a, expected_b = (rank, model.vocab_size), (model.hidden_size, rank)
        else:
            out_features, in_features = linear_shape(model, module)
            expected_a, expected_b = (rank, in_features), (out_features, rank)
        _check_shapes(where, f"module {module!r} (layer {layer})", a, b, expected_a, expected_b, f"r={rank} and the model")
        deltas[(layer, module)] = ModuleDelta(a, b, scaling)
    return deltas


def _check_shapes(where: Path, what: str, a: torch.Tensor, b: torch.Tensor, expected_a: tuple, expected_b: tuple, implied_by: str) -> None:
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise ValueError(f"{where}: {what} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                         f"{implied_by} imply A {expected_a} and B {expected_b}")
