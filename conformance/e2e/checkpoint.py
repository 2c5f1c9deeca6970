"""The tiny checkpoints the end-to-end cases run: their config, weights and tokenizer.

Three architectures: Llama (dense MLP), Mixtral (every layer's MLP a set of experts with a top-k router;
attention, norms, embedding and head as Llama's) and Cohere (Command-R: a parallel block, see
:class:`ParallelBlockConfig`). A Mixtral checkpoint stores one tensor per expert
(``block_sparse_moe.experts.<e>.w1/w2/w3``, as transformers 5's ``save_pretrained`` writes it and vLLM
reads it); loading fuses them, as transformers does, into ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, with the router as ``mlp.gate.weight``.
A Cohere checkpoint has no ``lm_head.weight`` (tied: it is the embedding, as transformers and vLLM load it).
A Llama token classifier (transformers' ``LlamaForTokenClassification``, ``num_labels`` from ``id2label``)
has the Llama backbone and, instead of the lm_head, a per-token head with bias: ``score.weight``
``[num_labels, hidden]`` and ``score.bias`` ``[num_labels]``.

Only safetensors weights are read (never pickles). A malformed file raises ``ValueError`` naming the
file and the field, and how to regenerate the fixtures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .fp8 import dequantize_experts

REGENERATE = "regenerate them with `python fixtures/make_fixtures.py`"


@dataclass(frozen=True)
class ExpertsConfig:
    """A Mixtral MLP: ``num_experts`` SwiGLU experts (of width ``intermediate_size``), ``top_k`` per token.

    The router takes the softmax of its logits over all experts, keeps the ``top_k`` largest and, with
    ``norm_topk_prob`` (always, in Mixtral), divides them by their sum.
    """

    num_experts: int
    top_k: int
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class ParallelBlockConfig:
    """A Cohere (Command-R) model, transformers' ``CohereForCausalLM`` without qk-norm.

    Each layer has one norm, and attention and MLP both read its output:
    ``x ← x + attn(norm(x)) + mlp(norm(x))``, so q, k, v, gate and up are five projections of one input.
    The norm is a LayerNorm without bias, ``(x − mean(x)) / √(var(x) + ε) · w``; the rotary embedding
    turns interleaved pairs of dimensions ``(2i, 2i + 1)`` (Llama's turns ``(i, i + d/2)``); the lm_head
    is the embedding (tied) and the logits are multiplied by ``logit_scale``.
    """

    logit_scale: float


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers of a decoder (``config.json``); ``experts`` for a Mixtral, ``parallel`` for a Cohere."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    norm_eps: float  # config.json's rms_norm_eps, or a Cohere's layer_norm_eps
    rope_theta: float
    max_position_embeddings: int
    bos_token_id: int
    experts: ExpertsConfig | None = None
    parallel: ParallelBlockConfig | None = None
    num_labels: int | None = None  # a token classifier's label count (its head replaces the lm_head)
    fp8_experts: bool = False  # a Mixtral whose experts are stored in fp8 (conformance.e2e.fp8)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def read(cls, path: Path) -> ModelConfig:
        raw = read_json(path)
        model_type = raw.get("model_type")
        if model_type not in _ARCHITECTURE_FIXED:
            raise ValueError(f"{path}: field 'model_type' must be one of {sorted(_ARCHITECTURE_FIXED)}, got {model_type!r}")
        raw = {**raw, "rope_theta": _rope_theta(raw, path)}
        for field, allowed in _ARCHITECTURE_FIXED[model_type].items():
            if raw.get(field, allowed) != allowed:
                raise ValueError(f"{path}: field {field!r} is {raw[field]!r}; the suite's decoder implements only {allowed!r}")
        fields = {name: kind for name, kind in cls.__annotations__.items()
                  if name not in ("experts", "parallel", "norm_eps", "num_labels", "fp8_experts")}
        eps_field = "layer_norm_eps" if model_type == "cohere" else "rms_norm_eps"
        config = cls(
            **_read_fields(raw, path, fields),
            norm_eps=_read_fields(raw, path, {eps_field: "float"})[eps_field],
            experts=_experts(raw, path) if model_type == "mixtral" else None,
            parallel=ParallelBlockConfig(**_read_fields(raw, path, {"logit_scale": "float"})) if model_type == "cohere" else None,
            num_labels=_num_labels(raw, path),
            fp8_experts=_fp8_experts(raw, path),
        )
        if config.hidden_size % config.num_attention_heads or config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(f"{path}: hidden_size, num_attention_heads and num_key_value_heads do not divide evenly")
        if raw.get("head_dim", config.head_dim) != config.head_dim:
            raise ValueError(f"{path}: field 'head_dim' must be hidden_size / num_attention_heads = {config.head_dim}")
        return config


# Per model_type, the architecture switches the decoder does not implement: anything else is refused,
# not approximated (the router's jitter noise acts only in training). A missing field takes the value
# allowed here, which is transformers' default for it. A Cohere config with rms_norm_eps is refused:
# vLLM's Cohere then builds RMSNorms where transformers' builds LayerNorms, so no decoder could match both.
_ARCHITECTURE_FIXED = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "pretraining_tp": 1},
    "mixtral": {"hidden_act": "silu", "tie_word_embeddings": False, "sliding_window": None},
    "cohere": {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True, "use_qk_norm": False, "rms_norm_eps": None},
}


def _read_fields(raw: dict, path: Path, fields: dict[str, str]) -> dict:
    """``fields`` (name → "int" or "float") read from ``raw``; a missing or mistyped one names itself."""
    values = {}
    for name, kind in fields.items():
        if name not in raw:
            raise ValueError(f"{path}: missing field {name!r}; {REGENERATE}")
        values[name] = float(raw[name]) if kind == "float" else raw[name]
        if kind == "int" and not isinstance(values[name], int):
            raise ValueError(f"{path}: field {name!r} must be an integer, got {raw[name]!r}")
    return values


TOKEN_CLASSIFIER = "LlamaForTokenClassification"


def _num_labels(raw: dict, path: Path) -> int | None:
    """A token classifier's label count (transformers reads it from ``id2label``); ``None`` for a causal LM."""
    architectures = raw.get("architectures") or []
    if TOKEN_CLASSIFIER not in architectures:
        return None
    if architectures != [TOKEN_CLASSIFIER] or raw.get("model_type") != "llama":
        raise ValueError(f"{path}: field 'architectures' is {architectures!r}; a token classifier must be [{TOKEN_CLASSIFIER!r}] "
                         f"of model_type 'llama'")
    if not raw.get("token_classification_bias", True):
        raise ValueError(f"{path}: field 'token_classification_bias' is false; the suite's decoder implements a head with bias")
    labels = raw.get("id2label")
    if not isinstance(labels, dict) or not labels:
        raise ValueError(f"{path}: missing field 'id2label' (a token classifier's labels); {REGENERATE}")
    return len(labels)


FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _fp8_experts(raw: dict, path: Path) -> bool:
    """Whether the checkpoint stores a Mixtral's experts in fp8 (``quantization_config``: vLLM's ``fp8`` method,
    dynamic activations); any other quantization is refused, not approximated."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return False
    if quantization != FP8_QUANTIZATION or raw.get("model_type") != "mixtral":
        raise ValueError(f"{path}: field 'quantization_config' is {quantization!r}; the suite's decoder implements only "
                         f"{FP8_QUANTIZATION!r} on a mixtral (fp8 experts)")
    return True


def _experts(raw: dict, path: Path) -> ExpertsConfig:
    values = _read_fields(raw, path, {"num_local_experts": "int", "num_experts_per_tok": "int"})
    experts, top_k = values["num_local_experts"], values["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ValueError(f"{path}: field 'num_experts_per_tok' is {top_k}; it must be in 1..num_local_experts ({experts})")
    return ExpertsConfig(experts, top_k)


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
        if config.experts is not None:
            weights = _fuse_experts(weights, config, path / "model.safetensors")
        if config.parallel is not None and "model.embed_tokens.weight" in weights:
            # tied, as transformers and vLLM load it (vLLM skips any lm_head.* tensor)
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        checkpoint = cls(path, config, weights)
        checkpoint._check_shapes()
        return checkpoint

    def _check_shapes(self) -> None:
        c = self.config
        expected = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
        if c.num_labels is None:
            expected["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        else:
            expected |= {"score.weight": (c.num_labels, c.hidden_size), "score.bias": (c.num_labels,)}
        for layer in range(c.num_hidden_layers):
            for name, shape in layer_shapes(c).items():
                expected[f"model.layers.{layer}.{name}"] = shape
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


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Weight shapes of one decoder layer, by tensor name (transformers' in-memory naming)."""
    h, i, kv = config.hidden_size, config.intermediate_size, config.kv_width
    if config.experts is None:
        mlp = {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    else:
        e = config.experts.num_experts
        mlp = {"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
    # a parallel block's one norm feeds attention and MLP alike
    norms = {"input_layernorm.weight": (h,)} | ({} if config.parallel else {"post_attention_layernorm.weight": (h,)})
    return {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        **mlp,
        **norms,
    }


def _fuse_experts(weights: dict[str, torch.Tensor], config: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """Per-expert Mixtral tensors (w1 gate, w3 up, w2 down) as transformers' fused expert parameters."""
    fused = dict(weights)

    def take(name: str) -> torch.Tensor:
        if name not in fused:
            raise ValueError(f"{where}: missing tensor {name!r}; {REGENERATE}")
        return fused.pop(name)

    def fp8(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight, scale = take(name + ".weight"), take(name + ".weight_scale")
        if weight.dtype != torch.float8_e4m3fn or scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"{where}: tensor {name + '.weight'!r} must be float8_e4m3fn with a one-element floating "
                             f"{name + '.weight_scale'!r} (got {weight.dtype}, {scale.dtype} {tuple(scale.shape)}); {REGENERATE}")
        return weight, scale.reshape(()).to(torch.float32)

    def expert(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert's gate/up (w1 rows, then w3 rows) and down weights, dequantized as vLLM's fp8 MoE does."""
        if config.fp8_experts:
            return dequantize_experts(*fp8(prefix + "w1"), *fp8(prefix + "w3"), *fp8(prefix + "w2"))
        w1, w3, w2 = (take(f"{prefix}{w}.weight") for w in ("w1", "w3", "w2"))
        try:
            return torch.cat([w1, w3]), w2
        except RuntimeError as exc:  # experts of unequal shapes
            raise ValueError(f"{where}: expert {prefix!r} has w1 and w3 of unequal shapes: {exc}") from None

    for layer in range(config.num_hidden_layers):
        old, new = f"model.layers.{layer}.block_sparse_moe.", f"model.layers.{layer}.mlp."
        fused[new + "gate.weight"] = take(old + "gate.weight")
        experts = [expert(f"{old}experts.{e}.") for e in range(config.experts.num_experts)]
        try:
            fused[new + "experts.gate_up_proj"] = torch.stack([gate_up for gate_up, _ in experts])
            fused[new + "experts.down_proj"] = torch.stack([down for _, down in experts])
        except RuntimeError as exc:  # experts of unequal shapes
            raise ValueError(f"{where}: the experts of layer {layer} do not stack: {exc}") from None
    leftover = sorted(name for name in fused if ".block_sparse_moe." in name)
    if leftover:
        raise ValueError(f"{where}: tensor {leftover[0]!r} is not one of the config's {config.experts.num_experts} experts")
    return fused


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
        if name.endswith(f".{module}.weight") and len(shape) == 2:
            return shape
    raise KeyError(f"no linear module named {module!r}")


def expert_shape(config: ModelConfig, parameter: str) -> tuple[int, int, int]:
    """``(experts, out_features, in_features)`` of a fused expert parameter (``gate_up_proj``, ``down_proj``)."""
    return layer_shapes(config)[f"mlp.experts.{parameter}"]
