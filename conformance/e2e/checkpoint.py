"""The tiny Llama-style checkpoint the end-to-end cases run: its config, weights and tokenizer.

Only safetensors weights are read (never pickles). A malformed file raises ``ValueError`` naming the
file and the field, and how to regenerate the fixtures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

REGENERATE = "regenerate them with `python conformance/fixtures/make_fixtures.py`"


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers of a Llama-style decoder (``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    bos_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def read(cls, path: Path) -> ModelConfig:
        raw = read_json(path)
        if raw.get("model_type") != "llama":
            raise ValueError(f"{path}: field 'model_type' must be 'llama', got {raw.get('model_type')!r}")
        raw = {**raw, "rope_theta": _rope_theta(raw, path)}
        for field, allowed in _ARCHITECTURE_FIXED.items():
            if raw.get(field, allowed) != allowed:
                raise ValueError(f"{path}: field {field!r} is {raw[field]!r}; the suite's decoder implements only {allowed!r}")
        values = {}
        for name, kind in cls.__annotations__.items():
            if name not in raw:
                raise ValueError(f"{path}: missing field {name!r}; {REGENERATE}")
            values[name] = float(raw[name]) if kind == "float" else raw[name]
            if kind == "int" and not isinstance(values[name], int):
                raise ValueError(f"{path}: field {name!r} must be an integer, got {raw[name]!r}")
        config = cls(**values)
        if config.hidden_size % config.num_attention_heads or config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f"{path}: hidden_size, num_attention_heads and num_key_value_heads do not divide evenly")
        if raw.get("head_dim", config.head_dim) != config.head_dim:
            raise ValueError(f"{path}: field 'head_dim' must be hidden_size / num_attention_heads = {config.head_dim}")
        return config


# Architecture switches the decoder does not implement: anything else is refused, not approximated.
_ARCHITECTURE_FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "pretraining_tp": 1,
}


def _rope_theta(raw: dict, path: Path) -> float:
    """transformers 5 writes ``rope_parameters``; older files a top-level ``rope_theta``."""
    parameters = raw.get("rope_parameters") or {}
    if parameters.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise ValueError(f"{path}: only the default rotary embedding is implemented (no rope scaling)")
    theta = parameters.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{path}: missing field 'rope_theta' (or rope_parameters.rope_theta); {REGENERATE}")
    return theta


@dataclass(frozen=True)
class Checkpoint:
    """A model directory: ``config.json``, ``model.safetensors`` and ``tokenizer.json``."""

    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]

    @classmethod
    def load(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        config = ModelConfig.read(path / "config.json")
        weights = read_safetensors(path / "model.safetensors")
        checkpoint = cls(path, config, weights)
        checkpoint._check_shapes()
        return checkpoint

    def _check_shapes(self) -> None:
        c = self.config
        expected = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,),
                    "lm_head.weight": (c.vocab_size, c.hidden_size)}
        for layer in range(c.num_hidden_layers):
            for name, shape in layer_shapes(c).items():
                expected[f"model.layers.{layer}.{name}.weight"] = shape
        for name, shape in expected.items():
            if name not in self.weights:
                raise ValueError(f"{self.path / 'model.safetensors'}: missing tensor {name!r}; {REGENERATE}")
            if tuple(self.weights[name].shape) != shape:
                raise ValueError(
                    f"{self.path / 'model.safetensors'}: tensor {name!r} has shape {tuple(self.weights[name].shape)}, "
                    f"config.json implies {shape}"
                )

    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json`` (the light library, not transformers)."""
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError("the end-to-end cases need the 'tokenizers' package: pip install tokenizers") from exc
        return Tokenizer.from_file(str(self.path / "tokenizer.json"))


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int] | tuple[int]]:
    """Weight shapes of one decoder layer, by module name (HF Llama naming)."""
    h, i, kv = config.hidden_size, config.intermediate_size, config.kv_width
    return {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
    }


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"{path} does not exist; weights are read from safetensors only; {REGENERATE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def read_json(path: Path, what: str = REGENERATE) -> dict:
    """A JSON file's object; a missing or malformed file raises ``ValueError`` naming it and ``what`` to do."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; {what}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def linear_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """``(out_features, in_features)`` of a linear module by its short name (``q_proj``, ``lm_head``)."""
    if module == "lm_head":
        return config.vocab_size, config.hidden_size
    for name, shape in layer_shapes(config).items():
        if name.endswith("." + module) and len(shape) == 2:
            return shape
    raise KeyError(f"no linear module named {module!r}")
