"""The KL to the reference as pure functions: one table of per-token estimators (KL_ESTIMATORS),
used as a reward penalty or as a loss term, the penalised token rewards, and the coefficient
controllers (fixed, adaptive). Shapes as in engine.algorithms.stats.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlflow.engine.algorithms.stats import LOG_RATIO_CLAMP, pick_variant, require_same_shape


def _kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio**2


def _kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # Schulman's k3 uses r = ref/policy, i.e. the negated log-ratio; clamp so exp cannot overflow.
    ref_over_policy = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(ref_over_policy) - ref_over_policy - 1.0


def _kl_abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


LOW_VAR_KL_BOUND = 10.0


def _low_var_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    # k3 (log-ratio clamped, so exp cannot overflow) with the result bounded too, so one runaway
    # token cannot dominate the loss: verl's low_var_kl.
    return _kl_k3(log_ratio).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


# Each takes log(pi/pi_ref) per token and returns a per-token KL(pi || pi_ref) estimate. With
# r = ref / policy of a sampled token:
#   k1 = -log r: unbiased value, high variance, negative for some tokens; as a loss its gradient's
#        expectation is 0 on-policy, so it does not pull towards the reference.
#   k2 = (log r)^2 / 2: biased value (exact to second order), always >= 0; as a loss its gradient
#        is the unbiased on-policy gradient of KL(policy || reference).
#   k3 = r - log r - 1: unbiased value, >= 0, low variance (log-ratio clamped to [-20, 20]); as a
#        loss its gradient is that of KL(reference || policy) to first order, i.e. biased for the
#        reverse KL.
#   abs = |log r|: a biased, >= 0 penalty.
#   low_var_kl: k3 bounded to [-10, 10] (verl's loss default); the bound adds bias only for tokens
#        whose probability ratio is beyond e^10 either way.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
    "abs": _kl_abs,
    "low_var_kl": _low_var_kl,
}


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) in nats, [B, T], unmasked and unreduced.

    logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens; the result carries the
    grad of ``logprobs`` (a loss term), never of the reference. estimator: a key of KL_ESTIMATORS
    (see its comment for each one's bias); an unknown one raises ValueError listing the valid ones.
    """
    kl_of_log_ratio = pick_variant(KL_ESTIMATORS, estimator, "KL estimator")
    require_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return kl_of_log_ratio(logprobs - ref_logprobs.detach())


def behaviour_weighted_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) from tokens another policy sampled, [B, T]:
    k3 x pi/pi_behaviour. k3 assumes samples of the policy itself; off-policy a token the policy
    now finds far less likely than the reference does gets a huge k3 (exp of the gap) although
    the policy would rarely draw it, and the importance weight takes it back to its share.

    logprobs, ref_logprobs, behaviour_logprobs: [B, T] log-probabilities of the sampled tokens
    under the policy, the reference and the sampler; no grad (a metric and a stop criterion)."""
    require_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, behaviour_logprobs=behaviour_logprobs)
    log_ratio = (logprobs - ref_logprobs).detach()
    return (torch.expm1(-log_ratio) + log_ratio) * torch.exp((logprobs - behaviour_logprobs).detach())


def compute_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token PPO reward: -kl_coef * kl on every response token, plus the sequence score
    added on the last real response token of each row.

    scores: [B] reward-model score per sequence; kl, response_mask: [B, T] (a contiguous prefix per
    row, or with gaps where a multi-turn row's observations sit; the score goes on the last 1).
    Returns [B, T] in reward units, 0 where the mask is 0.
    Raises ValueError if a row has no response token, since its score would be lost.
    """
    require_same_shape(kl=kl, response_mask=response_mask)
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"scores must be [B]={tuple(kl.shape[:1])}, got {tuple(scores.shape)}")
    lengths = response_mask.bool().sum(dim=-1)
    if bool((lengths == 0).any()):
        raise ValueError("every row needs at least one response token to carry its score")
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(response_mask.bool(), -kl_coef * kl, zero)
    positions = torch.arange(response_mask.shape[-1], device=kl.device)
    last_index = torch.where(response_mask.bool(), positions, -1).amax(-1, keepdim=True)
    return rewards.scatter_add(-1, last_index, scores.to(kl.dtype).unsqueeze(-1))


# --------------------------------------------------------------------------- KL controllers


def _finite_float(value, name: str) -> float:
    value = float(value)
    # A single nan/inf KL would otherwise stick in the coefficient for the rest of training.
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class FixedKLController:
    """KL coefficient that never changes; ``update`` is a no-op kept for a common interface."""

    def __init__(self, init_coef: float):
        self.value = _finite_float(init_coef, "init_coef")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Ignore the observed KL (nats) and step count."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = _finite_float(state["value"], "state['value']")


class AdaptiveKLController:
    """Proportional KL-coefficient controller (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences"), steering the observed KL (nats) towards ``target``.

    On each update: e = clip(current_kl / target - 1, -0.2, 0.2);
    value *= 1 + e * n_steps / horizon. ``horizon`` is in the same unit as ``n_steps``.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        self.value = _finite_float(init_coef, "init_coef")
        if not target > 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the coefficient that would give ``target`` KL."""
        current_kl = _finite_float(current_kl, "current_kl")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # target and horizon are configuration, not state: a resumed run uses its own config.
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = _finite_float(state["value"], "state['value']")


KL_CONTROLLERS: dict[str, type] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
}


def make_kl_controller(
    kind: str, init_coef: float, target: float, horizon: float
) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller by name ("fixed" ignores target and horizon).

    Unknown kind raises ValueError listing the valid kinds.
    """
    controller_cls = pick_variant(KL_CONTROLLERS, kind, "KL controller kind")
    if controller_cls is FixedKLController:
        return FixedKLController(init_coef)
    return AdaptiveKLController(init_coef, target, horizon)
