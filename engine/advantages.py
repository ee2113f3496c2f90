"""Policy-gradient advantage estimators and the KL-to-reference loss, as pure functions.

Every estimator has one signature, so `algorithm.name` picks one from ``ADVANTAGE_ESTIMATORS``:

    estimator(token_rewards [B, T], values [B, T], response_mask [B, T], group_size, gamma, lam, norm_std)
        -> (advantages [B, T], returns [B, T])

``token_rewards`` holds each row's score on its last real token, plus (when the KL is in the
reward) -kl_coef * KL on every token; its row sum is the sequence's return. Rows come in groups of
``group_size`` consecutive samples of one prompt (rollout.n). ``values`` is the critic's (zeros
for the critic-free estimators, which ignore it). Outputs are detached and 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.engine.algos import (
    KL_ESTIMATORS,
    _pick,
    _require_same_shape,
    compute_gae_advantages,
    masked_sum,
    masked_whiten,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_LOSSES",
    "compute_advantages",
    "compute_gae_estimator",
    "compute_grpo_outcome_advantages",
    "compute_reinforce_pp_advantages",
    "compute_rloo_outcome_advantages",
    "kl_loss",
]

# A group whose rewards are all equal has std 0; its centred rewards are exactly 0 too, so the
# epsilon only has to keep 0 / 0 from being nan.
GROUP_STD_EPS = 1e-6
LOW_VAR_KL_BOUND = 10.0


def _grouped(outcome: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] -> [B / n, n]; each row of the result is one prompt's samples."""
    if group_size < 1 or outcome.shape[0] % group_size:
        raise ValueError(f"{outcome.shape[0]} rows do not split into groups of rollout.n={group_size}")
    return outcome.reshape(-1, group_size)


def _outcome(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each row's return: the sum of its token rewards [B] (score, minus the KL penalty if any)."""
    return masked_sum(token_rewards.detach(), response_mask, dim=-1)


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sequence's advantage on each of its real tokens, 0 on padding."""
    zero = torch.zeros((), dtype=per_row.dtype, device=per_row.device)
    return torch.where(response_mask.bool(), per_row.unsqueeze(-1).expand(response_mask.shape), zero)


def compute_grpo_outcome_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int, norm_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): each sample's return minus its group's mean, divided by the
    group's (unbiased) std if ``norm_std``; the same advantage on every token of the sample.

    token_rewards, response_mask: [B, T], B a multiple of group_size. Returns (advantages,
    returns), both [B, T]; returns = advantages (there is no critic to fit). A group whose returns
    are all equal gets advantage 0 (never nan). A group of 1 has no spread: advantage 0.
    """
    _require_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    grouped = _grouped(_outcome(token_rewards, response_mask), group_size)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if norm_std and group_size > 1:
        centred = centred / (grouped.std(dim=-1, keepdim=True) + GROUP_STD_EPS)
    advantages = _broadcast(centred.reshape(-1), response_mask)
    return advantages, advantages


def compute_rloo_outcome_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): each sample's return minus the mean return of the OTHER
    samples of its prompt, i.e. n / (n - 1) times its distance from the group mean.

    token_rewards, response_mask: [B, T], B a multiple of group_size >= 2. Returns (advantages,
    returns), both [B, T], the same value on every real token of a row; equal returns give 0.
    """
    _require_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    if group_size < 2:
        raise ValueError(f"RLOO needs rollout.n >= 2 samples per prompt for a leave-one-out baseline, got {group_size}")
    grouped = _grouped(_outcome(token_rewards, response_mask), group_size)
    baseline = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    advantages = _broadcast((grouped - baseline).reshape(-1), response_mask)
    return advantages, advantages


def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): per-token discounted returns G_t = sum_{k>=t} gamma^(k-t) r_k of the
    KL-penalised token rewards, then normalised to zero mean and unit variance over every real
    token of the whole batch (no critic, no group).

    token_rewards, response_mask: [B, T]. Returns (advantages = whitened returns, returns), [B, T].
    A batch with fewer than two real tokens cannot be normalised: its advantages are its returns.
    """
    _require_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    keep = response_mask.bool()
    rewards = torch.where(keep, token_rewards.detach(), torch.zeros((), dtype=token_rewards.dtype))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = torch.where(keep, returns, torch.zeros((), dtype=returns.dtype))
    if int(keep.sum()) < 2:
        return returns, returns
    return masked_whiten(returns, response_mask), returns


def compute_gae_estimator(token_rewards, values, response_mask, group_size, gamma, lam, norm_std):
    """PPO's estimator: GAE over the critic's values (algos.compute_gae_advantages)."""
    return compute_gae_advantages(token_rewards, values, response_mask, gamma, lam)


def _grpo(token_rewards, values, response_mask, group_size, gamma, lam, norm_std):
    return compute_grpo_outcome_advantages(token_rewards, response_mask, group_size, norm_std)


def _rloo(token_rewards, values, response_mask, group_size, gamma, lam, norm_std):
    return compute_rloo_outcome_advantages(token_rewards, response_mask, group_size)


def _reinforce_pp(token_rewards, values, response_mask, group_size, gamma, lam, norm_std):
    return compute_reinforce_pp_advantages(token_rewards, response_mask, gamma)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "ppo": compute_gae_estimator,
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
}


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int = 1,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T], by the estimator ``name`` (a key of
    ADVANTAGE_ESTIMATORS; an unknown name raises ValueError listing the valid ones)."""
    estimator = _pick(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
    return estimator(token_rewards, values, response_mask, group_size, gamma, lam, norm_std)


def _low_var_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    # k3 (log-ratio clamped, so exp cannot overflow) with the result bounded too, so one runaway
    # token cannot dominate the loss: verl's low_var_kl.
    return KL_ESTIMATORS["k3"](log_ratio).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


# Per-token KL(policy || reference) as a loss term. With r = ref / policy of a sampled token:
#   k1 = -log r: unbiased value, high variance, negative for some tokens; as a loss its
#        gradient's expectation is 0 on-policy, so it does not pull towards the reference.
#   k2 = (log r)^2 / 2: biased value (exact to second order), always >= 0; as a loss its gradient
#        is the unbiased on-policy gradient of KL(policy || reference).
#   k3 = r - log r - 1: unbiased value, >= 0, low variance; as a loss its gradient is that of
#        KL(reference || policy) to first order, i.e. biased for the reverse KL.
#   low_var_kl: k3 bounded to [-10, 10] (verl's default); the bound adds bias only for tokens
#        whose probability ratio is beyond e^10 either way.
KL_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": KL_ESTIMATORS["k1"],
    "k2": KL_ESTIMATORS["k2"],
    "k3": KL_ESTIMATORS["k3"],  # its log-ratio is clamped to [-20, 20]: exp cannot overflow
    "low_var_kl": _low_var_kl,
}


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL loss [B, T] (nats, unreduced, carries the grad of ``logprobs``).

    logprobs (current policy), ref_logprobs (reference, no grad): [B, T] log-probabilities of the
    sampled tokens. kind: a key of KL_LOSSES (see its comment for each one's bias)."""
    estimator = _pick(KL_LOSSES, kind, "KL loss type")
    _require_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return estimator(logprobs - ref_logprobs.detach())
