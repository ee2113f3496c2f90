"""Correction for the gap between the policy that sampled a batch and the trainer's, as pure functions.

The sampler (the behaviour policy: a rollout replica, HF or vLLM, or an older actor version in
off-policy training) and the trainer's proximal policy (its own log-probs of the same tokens at
sampling time, `old_logprobs`) are not the same distribution: other kernels, other precision, or
other weights. The decoupled PPO objective (Hilton et al. 2022) keeps them apart: the clipped
surrogate compares the current policy with the proximal one, and the importance weight

    w = pi_old(y) / pi_behaviour(y)   (per token, or per sequence: the product over its tokens)

multiplies each token's loss, detached. ``CORRECTIONS`` (`algorithm.rollout_correction`) says what
is done with w, given a cap C > 1:
  - none: w is not applied (weight 1);
  - tis:  truncated importance sampling, min(w, C) (Ionides 2008; Yao et al. 2025 for RL on LLMs);
  - mis:  masked importance sampling, w where 1/C <= w <= C and 0 outside (IcePop, 2025): a
          token (or sequence) the sampler saw very differently contributes nothing. Its tokens
          still count in the loss's normaliser, so a batch with many masked tokens takes a smaller
          step instead of amplifying the rest.
Shapes: [B, T] throughout, T response tokens; mask is 1 on real response tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.engine.algorithms.kl import token_kl
from rlflow.engine.algorithms.stats import LOG_RATIO_CLAMP, masked_mean, masked_sum, pick_variant, require_same_shape

__all__ = ["CORRECTIONS", "CORRECTION_LEVELS", "correction_metrics", "importance_weights", "raw_importance_weights"]

CORRECTION_LEVELS = ("token", "sequence")


def raw_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """w = pi_old / pi_behaviour [B, T], detached: per token, or per sequence (exp of the row's summed
    log-ratio, the same on each of its tokens). 1 on padding. Log-ratios are clamped to +-20."""
    require_same_shape(old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown correction level {level!r}; valid levels: {', '.join(CORRECTION_LEVELS)}")
    log_ratio = (old_logprobs - behaviour_logprobs).detach() * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio) * mask
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _none(raw: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.ones_like(raw)


def _truncated(raw: torch.Tensor, cap: float) -> torch.Tensor:
    return raw.clamp(max=cap)


def _masked(raw: torch.Tensor, cap: float) -> torch.Tensor:
    inside = (raw >= 1.0 / cap) & (raw <= cap)
    return torch.where(inside, raw, torch.zeros_like(raw))


# Each maps (raw weights [B, T], cap) to the weights [B, T] that multiply the per-token loss.
CORRECTIONS: dict[str, Callable] = {"none": _none, "tis": _truncated, "mis": _masked}


def importance_weights(raw: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """The weights [B, T] of correction `mode` (a key of ``CORRECTIONS``) for raw weights [B, T]
    and cap C > 1; an unknown mode raises ValueError listing the valid ones."""
    correction = pick_variant(CORRECTIONS, mode, "rollout correction")
    if not cap > 1.0:
        raise ValueError(f"the rollout-correction cap must be > 1, got {cap}")
    return correction(raw, cap)


def correction_metrics(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    raw: torch.Tensor,
    weights: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """0-dim tensors over the masked tokens:
    rollout/mismatch_kl: the k3 estimate of KL(behaviour || old), nats per token (the tokens were
        drawn from the behaviour policy, which is what k3 needs to be unbiased);
    rollout/is_weight_mean, /is_weight_max: of the raw weights w, before capping or masking;
    rollout/masked_fraction: share of tokens whose weight the correction set to 0;
    rollout/capped_fraction: share of tokens whose weight it lowered to the cap."""
    tokens = mask.bool()
    count = tokens.sum().clamp(min=1)
    zeroed = tokens & (weights == 0) & (raw > 0)
    capped = tokens & (weights > 0) & (weights < raw)
    return {
        # k3 >= 0; exp(x) - x - 1 rounds to ~-1e-9 at x ~ 0, which is no KL
        "rollout/mismatch_kl": masked_mean(token_kl(behaviour_logprobs, old_logprobs, "k3").clamp(min=0.0), mask),
        "rollout/is_weight_mean": masked_mean(raw, mask),
        "rollout/is_weight_max": raw.masked_fill(~tokens, float("-inf")).max().clamp(min=0.0),
        "rollout/masked_fraction": zeroed.sum() / count,
        "rollout/capped_fraction": masked_sum(capped.to(raw.dtype), mask) / count,
    }
