"""A decoder-only model's shape, from an HF config.json or from a parameter count alone.

Everything the cost estimate needs (parameter counts, FLOPs per token, KV-cache bytes, the
activation terms) follows from these few integers, so no weights are ever loaded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlflow.engine.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """Llama/Qwen2/Mistral-style decoder (OPT/GPT-2 style with gated_mlp=False, layer_norm=True)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: K and V have this many heads
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True  # SwiGLU: gate, up and down matrices; False: fc1 and fc2 (OPT, GPT-2)
    layer_norm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight only)
    bias_qkv: bool = False  # Qwen2; Llama's attention_bias also sets bias_out
    bias_out: bool = False
    bias_mlp: bool = False
    source: str = ""  # where the shape came from, for the report

    @property
    def q_width(self) -> int:
        """Width of the attention's query projection (heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of each of the K and V projections (kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, MLP and its two norms."""
        h, i = self.hidden_size, self.intermediate_size
        attention = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        attention += (self.q_width + 2 * self.kv_width) * self.bias_qkv + h * self.bias_out
        matrices = 3 if self.gated_mlp else 2
        mlp = matrices * h * i + ((matrices - 1) * i + h) * self.bias_mlp
        return attention + mlp + 2 * self._norm_params

    @property
    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.layer_norm else 1)

    @property
    def backbone_params(self) -> int:
        """Embedding + layers + final norm: what a causal LM and a scalar-head model share."""
        return self.vocab_size * self.hidden_size + self.num_layers * self.layer_params + self._norm_params

    @property
    def lm_params(self) -> int:
        """Parameters of the causal LM (actor, reference): backbone + LM head unless tied."""
        return self.backbone_params + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def scalar_params(self) -> int:
        """Parameters of the one-output sequence-classification model (critic, reward model):
        backbone + a bias-free [hidden -> 1] score head, no LM head."""
        return self.backbone_params + self.hidden_size

    @property
    def lm_flop_params(self) -> int:
        """Parameters that do a multiply-add per token in a causal LM's forward: everything but the
        embedding lookup, LM head included (even when tied to the embedding)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def scalar_flop_params(self) -> int:
        """As lm_flop_params for a scalar-head model: no [hidden x vocab] matmul at all."""
        return self.num_layers * self.layer_params + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token occupies: 2 (K and V) * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _required(config: dict[str, Any], key: str, source: str, *aliases: str) -> int:
    for name in (key, *aliases):
        if isinstance(config.get(name), int) and config[name] > 0:
            return config[name]
    raise ConfigError(f"{source}: config.json has no positive integer '{key}'; a decoder model's config needs it")


def shape_from_hf_config(config: dict[str, Any], source: str) -> ModelShape:
    """A ModelShape from a parsed HF config.json (Llama, Qwen2, Mistral keys; OPT's ffn_dim)."""
    config = config.get("text_config", config) if "hidden_size" not in config else config
    model_type = str(config.get("model_type", ""))
    hidden = _required(config, "hidden_size", source)
    heads = _required(config, "num_attention_heads", source)
    head_dim = config.get("head_dim") or hidden // heads
    attention_bias = bool(config.get("attention_bias", False))
    opt_style = model_type in ("opt", "gpt2") or "ffn_dim" in config
    return ModelShape(
        hidden_size=hidden,
        num_layers=_required(config, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=_required(config, "intermediate_size", source, "ffn_dim"),
        vocab_size=_required(config, "vocab_size", source),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        gated_mlp=not opt_style,
        layer_norm=opt_style,
        bias_qkv=attention_bias or model_type == "qwen2" or opt_style,
        bias_out=attention_bias or opt_style,
        bias_mlp=bool(config.get("mlp_bias", False)) or opt_style,
        source=source,
    )


def load_model_shape(path: str | Path) -> ModelShape:
    """The shape in `path`/config.json; ConfigError if the folder or the file is missing or bad."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ConfigError(
            f"model {str(path)!r} is neither a local model folder nor a size like 7B or 0.5B: give a Hugging Face"
            " directory holding config.json, or a parameter count (--model 7B)"
        )
    if not config_file.is_file():
        raise ConfigError(f"model folder {str(path)!r} has no config.json: point at a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_file}: not readable JSON ({exc.__class__.__name__})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: the top level must be a JSON object")
    return shape_from_hf_config(config, str(config_file))


# Published shapes of common open models (their config.json values). A bare size picks the one
# nearest in parameter count: real aspect ratios (depth vs width, GQA, vocabulary) beat a formula,
# and the vocabulary matters for small models (logits dominate their activation memory).
REFERENCE_SHAPES: dict[str, ModelShape] = {
    "Qwen2.5-0.5B": ModelShape(896, 24, 14, 2, 64, 4864, 151936, True, bias_qkv=True),
    "Qwen2.5-1.5B": ModelShape(1536, 28, 12, 2, 128, 8960, 151936, True, bias_qkv=True),
    "Llama-3.2-3B": ModelShape(3072, 28, 24, 8, 128, 8192, 128256, True),
    "Llama-2-7B": ModelShape(4096, 32, 32, 32, 128, 11008, 32000, False),
    "Llama-3.1-8B": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False),
    "Llama-2-13B": ModelShape(5120, 40, 40, 40, 128, 13824, 32000, False),
    "Qwen2.5-32B": ModelShape(5120, 64, 40, 8, 128, 27648, 152064, False, bias_qkv=True),
    "Llama-3.1-70B": ModelShape(8192, 80, 64, 8, 128, 28672, 128256, False),
}
# Within this factor of a reference's count the reference is used as it is; further away its
# number of layers is scaled to reach the asked count (width and vocabulary kept).
SAME_SIZE_FACTOR = 1.15

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT]?)\s*$")
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_size(text: str) -> float | None:
    """'7B' -> 7e9, '350M' -> 3.5e8, '1.5b' -> 1.5e9, '7e9' -> 7e9; None if `text` is not a size."""
    match = _SIZE.match(text)
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else float(text)
    except ValueError:
        return None
    return value if value >= 1e6 else None  # a bare small number is more likely a typo than a model


def shape_from_size(n_params: float) -> ModelShape:
    """The reference shape nearest (in log ratio) to `n_params` causal-LM parameters; further than
    SAME_SIZE_FACTOR from it, its layer count is scaled to reach `n_params`."""
    if n_params < 1e6:
        raise ConfigError(f"model size {n_params:g} parameters is too small to estimate; give e.g. 0.5B or 7B")
    name, ref = min(REFERENCE_SHAPES.items(), key=lambda item: abs(_log_ratio(item[1].lm_params, n_params)))
    if abs(_log_ratio(ref.lm_params, n_params)) <= _log_ratio(SAME_SIZE_FACTOR, 1.0):
        return replace(ref, source=f"{_billions(n_params)} -> shape of {name} ({_billions(ref.lm_params)} params)")
    fixed = ref.lm_params - ref.num_layers * ref.layer_params
    layers = max(1, round((n_params - fixed) / ref.layer_params))
    scaled = replace(ref, num_layers=layers)
    return replace(
        scaled,
        source=f"{_billions(n_params)} -> {name} widths with {layers} layers ({_billions(scaled.lm_params)} params)",
    )


def _log_ratio(a: float, b: float) -> float:
    return math.log(a / b)


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}B"


def resolve_model(spec: str) -> ModelShape:
    """`spec` is a size ('7B', '0.5B', '350M') or a local HF model folder."""
    size = parse_size(spec)
    return shape_from_size(size) if size is not None else load_model_shape(spec)


# Linear layers of one decoder layer by their short name (Llama/Qwen2/Mistral, and OPT's), as
# (in, out) widths; what model.lora.target_modules names.
def layer_matrices(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_width, shape.kv_width
    attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv)}
    if not shape.gated_mlp:  # OPT: out_proj, fc1, fc2
        return attention | {"out_proj": (q, h), "fc1": (h, i), "fc2": (i, h)}
    return attention | {"o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


EMBEDDING_NAMES = ("embed_tokens", "embed_in", "wte", "lm_head", "embed_out")


@dataclass(frozen=True)
class LoraShape:
    """model.lora as the estimate needs it: the adapters' rank, the layers they sit on and the
    modules that train whole. Counts follow engine/models/lora.py (peft): r x (in + out) per adapted
    matrix per layer; a tied embedding and LM head in modules_to_save are one trained tensor."""

    r: int
    targets: tuple[str, ...]  # short names, or ("all-linear",)
    whole: tuple[str, ...] = ()  # modules_to_save

    def adapter_params(self, shape: ModelShape) -> int:
        """Parameters of the adapters on one model of `shape` (all its layers)."""
        matrices = layer_matrices(shape)
        names = list(matrices) if self.targets == ("all-linear",) else self.targets
        unknown = [n for n in names if n not in matrices]
        if unknown:
            raise ConfigError(
                f"model.lora.target_modules: the estimate knows the linear layers {', '.join(matrices)};"
                f" {', '.join(unknown)} is none of them"
            )
        return shape.num_layers * sum(self.r * sum(matrices[n]) for n in names)

    def whole_params(self, shape: ModelShape, scalar: bool) -> int:
        """Parameters of modules_to_save on a causal LM (scalar=False) or a scalar-head model: an
        embedding-sized copy per embedding or LM head named (one when tied; a scalar model has no
        LM head), a layer's matrix x layers for a linear name; norms and the like are negligible."""
        vocab = shape.vocab_size * shape.hidden_size
        embeddings = {n for n in self.whole if n in EMBEDDING_NAMES}
        if scalar:
            embeddings = {n for n in embeddings if n not in ("lm_head", "embed_out")}
        copies = 1 if embeddings and (shape.tie_word_embeddings or scalar) else len(embeddings)
        matrices = layer_matrices(shape)
        linear = sum(shape.num_layers * math.prod(matrices[n]) for n in self.whole if n in matrices)
        return copies * vocab + linear

    def trainable(self, shape: ModelShape, scalar: bool) -> int:
        """Trainable parameters of a LoRA model: adapters, modules_to_save, and a scalar model's head."""
        return self.adapter_params(shape) + self.whole_params(shape, scalar) + (shape.hidden_size if scalar else 0)

    def weight_grad_flop_params(self, shape: ModelShape, scalar: bool) -> int:
        """Matmul parameters whose weight gradient the backward still computes (the LM head's when
        it trains whole, linear modules_to_save); the adapters' own are negligible."""
        head = (
            not scalar
            and any(n in self.whole for n in ("lm_head", "embed_out"))
            or (not scalar and shape.tie_word_embeddings and any(n in self.whole for n in EMBEDDING_NAMES))
        )
        matrices = layer_matrices(shape)
        linear = sum(shape.num_layers * math.prod(matrices[n]) for n in self.whole if n in matrices)
        return (shape.vocab_size * shape.hidden_size if head else 0) + linear
