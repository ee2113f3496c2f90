"""Next-token log-probs and entropy without full-width logits: the LM head applied per chunk.

At a real vocabulary the fp32 logits [B, T, V] dominate a step's memory (64 x 128 tokens at
V = 49152: 1.6 GB, and log_softmax keeps another). Here the model runs its own forward (a
DeepSpeed engine counts its micro-steps there) with the LM head's input captured and the head
itself fed zero positions; the head is then applied to `chunk_tokens` positions at a time, each
chunk under activation checkpointing, so autograd keeps only the hidden states and the per-token
results, and recomputes one chunk's logits at a time in the backward pass. Up to MAX_KEPT_LOGITS
logits in all, the chunks are kept instead of recomputed: there the recompute costs more time than
the memory is worth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Positions per chunk of the LM head (1024 x 49152 fp32 logits: 200 MB); None: logits whole. A
# module constant, read at each call, so a benchmark can compare both in one process.
CHUNK_TOKENS: int | None = 1024
# Below this many logits (positions x vocabulary; 4 MB in fp32) the head runs whole, as before:
# nothing to save, and a tiny model's numbers stay bit for bit what they were.
MIN_CHUNKED_LOGITS = 2**20
# Up to this many logits (64 MB in fp32) autograd keeps each chunk's vocabulary-wide tensors for the
# backward (about three of them: ~190 MB at most) instead of running the head and its softmax again
# there. At SmolLM2, 8 x 32 response tokens (the bench's GRPO batch), the actor's forward and backward
# took 1.70 s recomputed and 1.57 s kept, with the same gradients bit for bit (bench/NOTES.md, change 6).
MAX_KEPT_LOGITS = 2**24


def _inner_model(model: nn.Module) -> tuple[nn.Module, Any]:
    """The HF model under DeepSpeed's engine, peft's wrapper or a LoRA reference view, and the
    context its head must run in (a reference view: adapters off)."""
    from rlflow.engine.models.lora import AdaptersOffView, adapters_disabled

    context: Any = contextlib.nullcontext
    inner = getattr(model, "module", model)  # a DeepSpeed engine
    if isinstance(inner, AdaptersOffView):
        inner, context = inner._model, (lambda m=inner._model: adapters_disabled(m))
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner, context


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that maps hidden states to logits, or None (then logits are computed whole)."""
    inner, _ = _inner_model(model)
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    return head if isinstance(head, nn.Module) else None


@contextlib.contextmanager
def _captured_head_input(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, the head's input is recorded and the head sees zero positions."""
    box: list[torch.Tensor] = []

    def pre_hook(module: nn.Module, args: tuple) -> tuple:
        box.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        yield box
    finally:
        handle.remove()


def _chunk_stats(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, ...]:
    """hidden [N, H], targets [N] -> (log-prob of each target [N], and its entropy [N] if asked),
    fp32 nats."""
    logits = head(hidden).float()
    if softcap:  # Gemma 2/3 cap their logits after the head
        logits = torch.tanh(logits / softcap) * softcap
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    picked = logprobs.gather(-1, targets[:, None].long()).squeeze(-1)
    if not with_entropy:
        return (picked,)
    floored = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)  # -inf x 0 is nan; see entropy_from_logits
    return picked, -(floored.exp() * floored).sum(-1)


def chunked_head_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    softcap: float | None = None,
    head_context: Any = contextlib.nullcontext,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropies of `targets` [B, K] given the head's input `hidden` [B, K, H].

    Returns [B, K] float32 tensors (nats); the entropy is None unless asked. With gradients on and
    more than MAX_KEPT_LOGITS logits in all, each chunk of `chunk_tokens` positions is
    checkpointed: its [chunk, V] logits live only while it is computed."""
    shape = targets.shape
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    vocab = getattr(head, "out_features", None)
    small = vocab is not None and flat_targets.numel() * vocab <= MAX_KEPT_LOGITS
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad and not small

    def stats(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with head_context():
            return _chunk_stats(head, h, t, temperature, softcap, with_entropy)

    parts = []
    for start in range(0, flat_targets.shape[0], chunk_tokens):
        h, t = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
        parts.append(checkpoint(stats, h, t, use_reentrant=False) if recompute else stats(h, t))
    if not parts:
        empty = flat_hidden.new_zeros(0, dtype=torch.float32).reshape(shape)
        return empty, (empty if with_entropy else None)
    columns = [torch.cat(column).reshape(shape) for column in zip(*parts)]
    return columns[0], (columns[1] if with_entropy else None)


def hidden_before_head(model: nn.Module, head: nn.Module, keep: int, **forward_kwargs: Any) -> torch.Tensor:
    """The head's input at the last `keep` positions [B, keep, H], from the model's own forward."""
    with _captured_head_input(head) as box:
        model(**forward_kwargs, logits_to_keep=keep)
    if len(box) != 1:
        raise RuntimeError(f"the LM head ran {len(box)} times in one forward pass; set engine.logits_chunk_tokens=null")
    return box[0]


_DEFAULT = object()


def next_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    forward_kwargs: dict[str, Any],
    start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: Any = _DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T - start] of tokens input_ids[:, start:] (each predicted at the position
    before it) and, if asked, the entropies there (else None): float32 nats, on the model's device.
    `chunk_tokens`: CHUNK_TOKENS unless given (then only from MIN_CHUNKED_LOGITS logits up); None
    computes the logits whole (also for a model without an output head)."""
    keep = input_ids.shape[1] - start + 1
    targets = input_ids[:, start:]
    head = output_head(model)
    if chunk_tokens is _DEFAULT:
        vocab = getattr(head, "out_features", None) or MIN_CHUNKED_LOGITS
        chunk_tokens = CHUNK_TOKENS if targets.numel() * vocab >= MIN_CHUNKED_LOGITS else None
    head = head if chunk_tokens else None
    if head is None:
        from rlflow.engine.algorithms.stats import entropy_from_logits

        logits = model(input_ids=input_ids, **forward_kwargs, logits_to_keep=keep).logits[:, :-1].float() / temperature
        # cross_entropy keeps [B, K] for its backward instead of a log_softmax [B, K, V]
        logprobs = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return logprobs, (entropy_from_logits(logits) if with_entropy else None)
    hidden = hidden_before_head(model, head, keep, input_ids=input_ids, **forward_kwargs)[:, :-1]
    inner, context = _inner_model(model)
    softcap = getattr(inner.config, "final_logit_softcapping", None)
    return chunked_head_logprobs(head, hidden, targets, temperature, chunk_tokens, softcap, context, with_entropy)
