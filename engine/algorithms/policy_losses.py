"""Per-token policy-gradient losses, chosen by `algorithm.policy_loss` from ``POLICY_LOSSES``.

Every loss has one signature, so the update never branches on the variant:

    loss(logprobs [B, T], old_logprobs [B, T], advantages [B, T], mask [B, T], clip_low, clip_high)
        -> (per_token_loss [B, T], per_token_clipped [B, T], per_token_approx_kl [B, T])

``logprobs`` is the current policy's (carries grad); ``old_logprobs`` the proximal policy's, the
trainer's own log-probs at sampling time (a behaviour policy that differs, such as an inference
engine's or an older version's, is corrected separately: engine/algorithms/rollout_correction.py).
The ratio r = pi / pi_old is clipped to [1 - clip_low, 1 + clip_high] (DAPO's asymmetric
clipping; PPO's symmetric clip when equal). Outputs are unmasked and unreduced: averaging is
engine/algorithms/losses.py's ``aggregate_loss``. ``per_token_clipped`` is 1.0 where the clip
took effect (the token's gradient is zero or its weight capped), ``per_token_approx_kl`` is
old_logprobs - logprobs (nats, detached: a k1 estimate of KL(old || new)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.engine.algorithms.stats import LOG_RATIO_CLAMP, masked_mean, pick_variant, require_same_shape

__all__ = ["POLICY_LOSSES", "cispo_policy_loss", "gspo_policy_loss", "policy_loss", "ppo_policy_loss"]


def _clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per token, and where the clipped term
    is strictly larger (taken). The log-ratio is clamped to +-20 so r stays finite; this never
    binds for a usable r."""
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token_clipped = (loss_clipped > loss_unclipped).to(ratio.dtype).detach()
    return torch.maximum(loss_unclipped, loss_clipped), per_token_clipped


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017), with DAPO's decoupled bounds
    (Yu et al. 2025): r = exp(logprobs - old_logprobs), loss = max(-A r, -A clip(r, 1 - clip_low,
    1 + clip_high)). A larger clip_high lets low-probability tokens gain more per step (against
    entropy collapse). `mask` is unused: each token stands alone."""
    require_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    per_token_loss, clipped = _clipped_surrogate(logprobs - old_logprobs, advantages, clip_low, clip_high)
    return per_token_loss, clipped, (old_logprobs - logprobs).detach()


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the length-normalised
    s = exp(mean over the row's masked tokens of (logprobs - old_logprobs)), clipped as a whole.

    Written token-wise as GSPO-token: token t carries s_t = sg(s) * pi_t / sg(pi_t), whose value
    is s on every token of the row and whose gradient is s * grad log pi_t. With per-row constant
    advantages and the seq-mean-token-mean aggregation, this is exactly the gradient of GSPO's
    sequence objective -min(s A, clip(s) A). A row is clipped (every token flagged) or not as a
    whole. GSPO's own bounds are small (3e-4 and 4e-4): a sequence ratio moves far less than a
    token's. A row with no masked token has s = 1."""
    require_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    sequence_log_ratio = masked_mean((logprobs - old_logprobs).detach(), mask, dim=-1)  # [B]
    token_log_ratio = sequence_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach()
    per_token_loss, clipped = _clipped_surrogate(token_log_ratio, advantages, clip_low, clip_high)
    return per_token_loss, clipped, (old_logprobs - logprobs).detach()


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logprobs.

    The importance weight is clipped and detached instead of the update, so every token keeps a
    gradient (PPO zeroes the gradient of a clipped token; rare tokens that open a reasoning step
    are the ones clipped most). At r inside the bounds the gradient equals PPO's, -A r grad log pi.
    MiniMax clips only above: set clip_low to 1 (no lower bound above 0). The loss value is not
    a surrogate of the return (it scales with log pi); read actor/pg_clipfrac and the rewards."""
    require_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = (weight != ratio).to(ratio.dtype)
    return -weight * advantages * logprobs, clipped, (old_logprobs - logprobs).detach()


POLICY_LOSSES: dict[str, Callable] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}


def policy_loss(name: str) -> Callable:
    """The loss `name` of ``POLICY_LOSSES``; an unknown name raises ValueError listing the valid ones."""
    return pick_variant(POLICY_LOSSES, name, "policy loss")
