"""rlflow's own KV-cached sampling loop, used for every rollout and evaluation in place of HF `generate`.

Why: sampling is the largest phase of an RL step on a CPU. At SmolLM2-135M, batch 8, HF `generate`
spends 73-109 ms per decode step (bench/decode_floor.py; Intel Xeon, AMD EPYC), against a
memory-bandwidth floor of 17-21 ms. The rest is the weight matmuls at MKL's plain-layout speed and
library overhead: module calls, cache objects, mask building, seven matmuls per layer, and a
multinomial draw that fills an exponential variate for every vocabulary entry of every row. For
Llama-family decoders (ARCHITECTURES) this module runs its own layer loop (_FastSteps), 49 ms per
step on the EPYC (2.8x its floor):
  - q/k/v and gate/up weights concatenated: four matmuls per layer instead of seven;
  - every weight matrix reordered into oneDNN's blocked layout for the batch, which reads it at
    8 rows up to ~2x faster than MKL reads the plain layout;
  - q/k rows paired so the rotary embedding is one complex multiply;
  - a preallocated KV cache and one boolean key mask, written in place;
  - the residual adds fused into the o/down matmuls.
Any other model, a GPU, or ZeRO-3's partitioned weights (whose forwards must run in lockstep on
every rank) step through the model's own cached forward instead (_ModelSteps); `unsupported_reason`
says why.

The draw is HF generate's: softmax(logits / T) after HF's top-p rule, then torch.multinomial's
sample on a generator seeded with the call's seed, which consumes the random stream exactly as
generate does after torch.manual_seed(seed) (rlflow.engine.rollout.draw fills the same exponential
variates as torch, vectorised: 5 ms instead of 8 per SmolLM2 step). Logits differ from HF's by
float rounding only (other matmul blocking), so the sampled and greedy tokens are generate's
unless a draw or an argmax is decided within that rounding: tests compare both paths with
generate token for token, and the demos' figures reproduce (docs/real-model.md). An inverse-CDF
draw would be cheaper still but would change every sampled token, and with them every measured
trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlflow.engine.rollout.draw import SeededDraw

ARCHITECTURES = ("llama", "qwen2")


def _config(model: torch.nn.Module):
    return getattr(model, "config", None)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this loop cannot run `model` (None: it can)."""
    cfg = _config(model)
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {ARCHITECTURES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp {cfg.pretraining_tp}"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        # On a GPU the costs are kernel launches, not CPU matmul layouts; unmeasured there, and
        # vLLM is the GPU sampler (engine/rollout/vllm_replica.py).
        return f"parameters on {sorted(devices)} (this loop is measured on CPU only)"
    if any(p.numel() == 0 for p in model.parameters()):
        return "partitioned weights (ZeRO-3)"
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:  # the rotary step is complex64; CPU training here is fp32
        return f"parameters in {sorted(map(str, dtypes))} (this loop runs fp32)"
    return None


@dataclass(frozen=True)
class _Linear:
    weight: torch.Tensor  # [out, in], or oneDNN's packed layout of it
    bias: torch.Tensor | None  # [out]
    packed: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(x), the add fused into the matmul where packed."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return residual + self(x)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: _Linear  # H -> (heads + 2 kv_heads) x head_dim, q/k rows rotary-paired
    o: _Linear  # heads x head_dim -> H
    post_norm: torch.Tensor  # [H]
    gate_up: _Linear  # H -> 2 x intermediate
    down: _Linear  # intermediate -> H


@dataclass(frozen=True)
class DecoderWeights:
    """The model's weights in this loop's layout, for one weight version and batch size.

    q/k rows are reordered within each head to pair dimension i with i + D/2, so the rotary
    embedding is one complex multiply instead of seven kernels; attention scores are unchanged
    (q and k reordered alike) and values keep their order."""

    embed: torch.Tensor  # [V, H]
    layers: tuple[_Layer, ...]
    norm: torch.Tensor  # [H]
    head: _Linear  # H -> V
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def _can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, batch: int) -> _Linear:
    """The matrix in oneDNN's layout for `batch` rows where this build has oneDNN, else as is."""
    if _can_pack(weight):
        return _Linear(torch.ops.mkldnn._reorder_linear_weight(weight, batch), bias, True)
    return _Linear(weight.contiguous(), bias, False)


def _rotary_pairs(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (or bias entries) of a q/k projection, [heads x D, ...], reordered within each head
    as 0, D/2, 1, D/2 + 1, ...: HF's rotate-half pairs become adjacent (real, imaginary) pairs."""
    dim = rows.shape[0] // heads
    order = torch.stack([torch.arange(dim // 2), torch.arange(dim // 2) + dim // 2], 1).flatten()
    return rows.view(heads, dim, *rows.shape[1:])[:, order].reshape(rows.shape)


@torch.no_grad()
def decoder_weights(model: torch.nn.Module, batch: int) -> DecoderWeights:
    """`model`'s weights (LoRA adapters merged, as rlflow.engine.models.lora computes them) in this loop's
    layout: a copy, built per call (~0.14 s at SmolLM2, against ~1.5 s of sampling). Not cached:
    a training step changes every weight anyway, and a rollout replica writes its weights through
    numpy, which no torch version counter sees, so a cache could serve stale weights."""
    from rlflow.engine.models.lora import merged_named_parameters

    params = dict(merged_named_parameters(model))
    cfg = _config(model)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads

    def fused(prefix: str, names: tuple[str, ...], pair: tuple[int, ...] = ()) -> _Linear:
        weights = [params[f"{prefix}{n}.weight"] for n in names]
        biases = [params.get(f"{prefix}{n}.bias") for n in names]
        for j, count in enumerate(pair):
            weights[j] = _rotary_pairs(weights[j], count)
            biases[j] = None if biases[j] is None else _rotary_pairs(biases[j], count)
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        # Every matrix packed (reordered per call, about a copy's cost: +0.03 s at SmolLM2). Packing
        # only the wide ones (output >= 3x input) left q/k/v, o and down on MKL's plain-layout path,
        # which reads weights at ~10 GB/s here against ~19 packed: a whole 32-token decode, same
        # tokens, measured side by side (bench/NOTES.md, change 6): SmolLM2 batch 8 1.81 -> 1.50 s,
        # batch 32 3.76 -> 3.37 s; the 50M bench model 0.62 -> 0.51 s; the demo's tiny Llama even.
        return _linear(weight, bias, batch)

    layers = []
    for i in range(cfg.num_hidden_layers):
        a, m, layer = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
        layers.append(
            _Layer(
                input_norm=params[f"{layer}input_layernorm.weight"],
                qkv=fused(a, ("q_proj", "k_proj", "v_proj"), (heads, kv_heads)),
                o=fused(a, ("o_proj",)),
                post_norm=params[f"{layer}post_attention_layernorm.weight"],
                gate_up=fused(m, ("gate_proj", "up_proj")),
                down=fused(m, ("down_proj",)),
            )
        )
    embed = params["model.embed_tokens.weight"]
    if "lm_head.weight" not in params:  # tied: named_parameters lists the shared tensor once
        params["lm_head.weight"] = embed
    return DecoderWeights(
        embed=embed,
        layers=tuple(layers),
        norm=params["model.norm.weight"],
        head=fused("", ("lm_head",)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=cfg.rms_norm_eps,
    )


def _forward(
    w: DecoderWeights,
    ids: torch.Tensor,
    start: int,
    rotation: torch.Tensor,
    mask: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Last-position logits [B, V] of `ids` [B, S] placed at cache slots start..start+S-1.

    rotation: [B, S, 1, D/2] complex rotary factors of those positions; mask: [B, 1, S, start+S]
    bool, True where a query may attend; cache: per layer (keys, values) [B, kv_heads, T, D],
    keys in rotary-paired order, written here."""
    batch, length = ids.shape
    heads, kv, dim, end = w.heads, w.kv_heads, w.head_dim, start + ids.shape[1]
    hidden = F.embedding(ids, w.embed)  # [B, S, H]
    width = (hidden.shape[-1],)
    for layer, (keys, values) in zip(w.layers, cache):
        qkv = layer.qkv(F.rms_norm(hidden, width, layer.input_norm, w.eps)).view(batch, length, heads + 2 * kv, dim)
        pairs = torch.view_as_complex(qkv[:, :, : heads + kv].unflatten(-1, (dim // 2, 2)))
        qk = torch.view_as_real(pairs * rotation).flatten(-2)  # [B, S, heads + kv, D]
        keys[:, :, start:end] = qk[:, :, heads:].transpose(1, 2)
        values[:, :, start:end] = qkv[:, :, heads + kv :].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            qk[:, :, :heads].transpose(1, 2), keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=True
        )
        hidden = layer.o.add(attended.transpose(1, 2).reshape(batch, length, heads * dim), hidden)
        gate, up = layer.gate_up(F.rms_norm(hidden, width, layer.post_norm, w.eps)).chunk(2, -1)
        hidden = layer.down.add(F.silu(gate) * up, hidden)
    return w.head(F.rms_norm(hidden[:, -1], width, w.norm, w.eps))


def _rotation(model: torch.nn.Module, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The model's own rotary embedding (every rope type it implements) at `positions` [B, T], as
    complex factors [B, T, 1, D/2] for rotary-paired q/k."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cos, sin = base.model.rotary_emb(like, positions)
    half = cos.shape[-1] // 2
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        # Every rope type of transformers' Llama and Qwen2 repeats its frequencies over both halves.
        name = type(base).__name__
        raise RuntimeError(f"{name}'s rotary tables are not rotate-half shaped: an rlflow bug, report it")
    return torch.complex(cos[..., :half].float(), sin[..., :half].float())[:, :, None].to(like.dtype.to_complex())


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF TopPLogitsWarper: keep the smallest set of most likely tokens whose probability reaches
    top_p (at least one), the rest -inf. logits: [B, V]."""
    if top_p >= 1.0:
        return logits
    ascending, order = logits.sort(-1)
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


@dataclass(frozen=True)
class Decoded:
    tokens: torch.Tensor  # [B, R] int64 sampled ids; pad after each row's first stop id
    logprobs: torch.Tensor  # [B, R] float32 log-prob of each token under softmax(logits / T), before top-p


class _FastSteps:
    """This module's layer loop over a preallocated cache: prefill, then one token per call."""

    def __init__(self, model: torch.nn.Module, attention: torch.Tensor, positions: torch.Tensor, total: int):
        batch, width = attention.shape
        self.weights = w = decoder_weights(model, batch)
        self.rotation = _rotation(model, positions, w.embed[:1])
        # Pad queries attend to themselves only: no row of the mask is empty (an empty one is NaN).
        self.keys_allowed = torch.zeros(batch, 1, 1, total, dtype=torch.bool, device=attention.device)
        self.keys_allowed[:, 0, 0, :width] = attention.bool()
        shape = (batch, w.kv_heads, total, w.head_dim)
        self.cache = [(w.embed.new_empty(shape), w.embed.new_empty(shape)) for _ in w.layers]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        width = ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        mask = (causal & self.keys_allowed[..., :width]) | torch.eye(width, dtype=torch.bool, device=ids.device)
        return _forward(self.weights, ids, 0, self.rotation[:, :width], mask, self.cache)

    def step(self, token: torch.Tensor, slot: int) -> torch.Tensor:
        self.keys_allowed[:, 0, 0, slot] = True
        rotation, mask = self.rotation[:, slot : slot + 1], self.keys_allowed[..., : slot + 1]
        return _forward(self.weights, token[:, None], slot, rotation, mask, self.cache)


class _ModelSteps:
    """The model's own cached forward, for what _FastSteps does not support (any architecture,
    a GPU, ZeRO-3's partitioned weights, which every forward gathers)."""

    def __init__(self, model: torch.nn.Module, attention: torch.Tensor, positions: torch.Tensor, total: int):
        from transformers import DynamicCache

        self.model, self.positions, self.cache = model, positions, DynamicCache(config=model.config)
        self.attention = torch.cat([attention, attention.new_ones(attention.shape[0], total - attention.shape[1])], 1)

    def _logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        end = start + ids.shape[1]
        out = self.model(
            input_ids=ids,
            attention_mask=self.attention[:, :end],
            position_ids=self.positions[:, start:end],
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._logits(ids, 0)

    def step(self, token: torch.Tensor, slot: int) -> torch.Tensor:
        return self._logits(token[:, None], slot)


def open_steps(model: torch.nn.Module, attention: torch.Tensor, new_tokens: int, synced: bool = False):
    """The cached forward the loops run over left-padded prompts (`attention` [B, P], on the model's
    device) and up to `new_tokens` more positions: `.prefill(ids [B, P])`, then `.step(token [B],
    slot)` for slots P, P+1, ..., each returning the last position's logits [B, V]."""
    width = attention.shape[1]
    prompt_positions = (attention.cumsum(1) - 1).clamp(min=0)
    new_positions = prompt_positions[:, -1:] + torch.arange(1, new_tokens + 1, device=attention.device)
    positions = torch.cat([prompt_positions, new_positions], 1)
    fast = not synced and unsupported_reason(model) is None
    return (_FastSteps if fast else _ModelSteps)(model, attention, positions, width + new_tokens)


def next_token(logits: torch.Tensor, temperature: float, top_p: float, draw: SeededDraw):
    """(token [B] int64, its log-prob [B] under softmax(logits / T), before top-p); T = 0 is greedy."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    if temperature > 0:  # HF generate's draw, on a generator seeded as its global one would be
        token = draw(filter_top_p(scaled, top_p).softmax(-1))
    else:
        token = scaled.argmax(-1)
    return token, scaled.log_softmax(-1).gather(1, token[:, None]).squeeze(1)


def _all_done(done: torch.Tensor, synced: bool) -> bool:
    if not synced:
        return bool(done.all())
    from rlflow.engine.backend import dist

    # Under ZeRO-3 every forward all-gathers weights: a rank must keep stepping until all are done.
    return int(dist.all_reduce_sum(float((~done).sum())).item()) == 0


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    seed: int,
    synced: bool = False,
    interrupt: Callable[[], bool] | None = None,
) -> Decoded:
    """Sample up to `max_new_tokens` after left-padded prompts `ids` [B, P] (`attention` [B, P],
    1 on real tokens); temperature 0 is greedy. Rows end at their first id in `stop_ids`; the
    loop stops when every row (on every rank, when `synced`) has ended, so R <= max_new_tokens.
    The layer loop is this module's where `unsupported_reason` allows, the model's own forward
    otherwise; the draw is the same either way, so the two agree token for token up to float
    rounding (a draw landing within ~1e-6 of a boundary). `interrupt`, asked after each token,
    cuts the loop short when it returns True (a partial rollout: the unfinished rows are the
    caller's to continue, under new weights), so R can be less with rows not ended."""
    batch, width = ids.shape
    device = next(model.parameters()).device
    ids, attention = ids.to(device), attention.to(device)
    steps = open_steps(model, attention, max_new_tokens, synced)
    logits = steps.prefill(ids)
    draw = SeededDraw(seed, device)
    stops = torch.tensor(list(stop_ids), device=device, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        token, logprob = next_token(logits, temperature, top_p, draw)
        logprobs.append(logprob)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        tokens.append(token)
        done |= torch.isin(token, stops)
        if step == max_new_tokens - 1 or _all_done(done, synced) or (interrupt is not None and interrupt()):
            break
        logits = steps.step(token, width + step)
    return Decoded(torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).cpu())
