"""Policy-gradient advantage estimators, as pure functions: GAE and the critic-free ones.

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

from rlflow.engine.algorithms.stats import masked_sum, masked_whiten, pick_variant, require_same_shape

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_STD_EPS",
    "compute_advantages",
    "compute_gae_advantages",
    "compute_gae_estimator",
    "compute_grpo_outcome_advantages",
    "compute_reinforce_pp_advantages",
    "compute_rloo_outcome_advantages",
]

# A group whose rewards are all equal has std 0; its centred rewards are exactly 0 too, so the
# epsilon only has to keep 0 / 0 from being nan.
GROUP_STD_EPS = 1e-6


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
    require_same_shape(token_rewards=token_rewards, response_mask=response_mask)
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
    require_same_shape(token_rewards=token_rewards, response_mask=response_mask)
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
    require_same_shape(token_rewards=token_rewards, response_mask=response_mask)
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
    estimator = pick_variant(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
    return estimator(token_rewards, values, response_mask, group_size, gamma, lam, norm_std)


def compute_gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over the model's own tokens.

    token_rewards, values, response_mask: [B, T]. Where the mask has gaps (a multi-turn
    trajectory's observation tokens, which the model did not choose) the recursion steps from
    each real token to the next real one, so the result equals GAE on the row with the gaps
    removed; a contiguous prefix is the usual single-turn case. The value after the last real
    token is bootstrapped as 0 (the episode ends). Returns (advantages, returns), both [B, T], in
    reward units; returns = advantages + values. Both are 0 where the mask is 0. Outputs are
    detached: they are regression and policy-gradient targets, never something to backpropagate
    through.
    """
    require_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(keep, token_rewards.detach(), zero)
    vals = torch.where(keep, values.detach(), zero)

    advantages_reversed = []
    # The value and advantage of the next real token: 0 past a row's last one.
    next_value = torch.zeros_like(vals[:, 0])
    next_advantage = torch.zeros_like(vals[:, 0])
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages_reversed.append(advantage)
        next_advantage = torch.where(keep[:, t], advantage, next_advantage)
        next_value = torch.where(keep[:, t], vals[:, t], next_value)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    advantages = torch.where(keep, advantages, zero)
    returns = torch.where(keep, advantages + vals, zero)
    return advantages, returns
