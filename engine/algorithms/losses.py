"""Per-token policy and value losses, and how they are averaged, as pure functions.

Per-token losses are returned unreduced; averaging is a separate, explicit choice made with
``aggregate_loss`` (LOSS_AGGREGATIONS). Shapes as in engine.algorithms.stats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.engine.algorithms.stats import LOG_RATIO_CLAMP, masked_mean, masked_sum, pick_variant, require_same_shape

# --------------------------------------------------------------------------- PPO losses


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, per token (Schulman et al. 2017).

    logprobs (current policy, carries grad), old_logprobs (behaviour policy), advantages:
    all [B, T]. With r = exp(logprobs - old_logprobs):
        loss = max(-A * r, -A * clip(r, 1 - clip_ratio, 1 + clip_ratio))
    Returns, all [B, T] and unmasked:
        per_token_loss (to minimise, advantage units),
        per_token_clipped (float 1.0 where the clipped term is strictly larger, i.e. taken),
        per_token_approx_kl (old_logprobs - logprobs, nats, detached; a k1 estimate of
        KL(old || new)).
    The log-ratio is clamped to [-20, 20] so r stays finite; this never binds for usable r.
    """
    require_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token_loss = torch.maximum(loss_unclipped, loss_clipped)
    per_token_clipped = (loss_clipped > loss_unclipped).to(logprobs.dtype).detach()
    per_token_approx_kl = (old_logprobs - logprobs).detach()
    return per_token_loss, per_token_clipped, per_token_approx_kl


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value-function loss, per token.

    values (current critic, carries grad), old_values (critic at rollout time), returns:
    all [B, T]. loss = 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2).
    Returns (per_token_loss in squared reward units, per_token_clipped: float 1.0 where the
    clipped error is strictly larger, i.e. taken), both [B, T] and unmasked.
    """
    require_same_shape(values=values, old_values=old_values, returns=returns)
    values_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    error_unclipped = (values - returns) ** 2
    error_clipped = (values_clipped - returns) ** 2
    per_token_loss = 0.5 * torch.maximum(error_unclipped, error_clipped)
    per_token_clipped = (error_clipped > error_unclipped).to(values.dtype).detach()
    return per_token_loss, per_token_clipped


def _token_mean(per_token, mask, num_tokens):
    denominator = mask.bool().sum().clamp(min=1) if num_tokens is None else num_tokens
    return masked_sum(per_token, mask) / denominator


def _seq_mean_token_sum(per_token, mask, num_tokens):
    return masked_sum(per_token, mask, dim=-1).mean()


def _seq_mean_token_mean(per_token, mask, num_tokens):
    return masked_mean(per_token, mask, dim=-1).mean()


# Each maps (per_token [B, T], mask [B, T], num_tokens) to a 0-dim loss.
LOSS_AGGREGATIONS: dict[str, Callable] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a 0-dim tensor over masked tokens.

    mode (a key of ``LOSS_AGGREGATIONS``):
        "token-mean": sum over masked tokens / (num_tokens if given else their count).
            Passing the global token count of all micro-batches makes the micro-batch
            losses sum to the token-mean of the whole batch.
        "seq-mean-token-sum": per-row sum over masked tokens, then mean over the B rows.
        "seq-mean-token-mean": per-row mean over masked tokens, then mean over the B rows
            (a row with no tokens contributes 0).
    num_tokens is only meaningful for "token-mean"; passing it with another mode raises
    ValueError rather than being silently ignored. Unknown mode raises ValueError.
    """
    aggregation = pick_variant(LOSS_AGGREGATIONS, mode, "loss aggregation mode")
    if num_tokens is not None:
        if mode != "token-mean":
            raise ValueError(f"num_tokens only applies to mode 'token-mean', not {mode!r}")
        if not isinstance(num_tokens, torch.Tensor) and num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return aggregation(per_token, mask, num_tokens)


def loss_sum_and_units(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, float]:
    """A micro-batch's share of an aggregated loss: (sum, units) with aggregate = sum / units.

    per_token, mask: [B, T]. Summing the sums of all micro-batches and ranks and dividing by their
    summed units gives ``aggregate_loss`` of the whole batch: units are masked tokens for
    "token-mean", rows for the "seq-mean-*" modes.
    """
    pick_variant(LOSS_AGGREGATIONS, mode, "loss aggregation mode")
    if mode == "token-mean":
        return masked_sum(per_token, mask), float(mask.bool().sum())
    per_row = (
        masked_sum(per_token, mask, dim=-1) if mode == "seq-mean-token-sum" else masked_mean(per_token, mask, dim=-1)
    )
    return per_row.sum(), float(per_token.shape[0])
