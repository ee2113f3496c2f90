"""RLHF/PPO maths as pure functions: tensors in, tensors out, no I/O and no config objects.

Shape conventions used throughout:
    B = batch size (sequences), T = response length (right-padded), V = vocabulary size.
    ``response_mask`` / ``mask`` is [B, T], 1 (or True) on real response tokens, 0 on padding.
Log-probabilities are natural logs (nats). Per-token losses are returned unreduced; averaging
is a separate, explicit choice made with ``aggregate_loss``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "compute_gae_advantages",
    "compute_token_rewards",
    "distinct_n",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "value_loss",
]

# exp(20) ~ 4.9e8 is far beyond any ratio PPO can use, yet exp of it stays finite in fp32.
LOG_RATIO_CLAMP = 20.0


def _pick(table: dict, key: str, what: str):
    try:
        return table[key]
    except KeyError:
        valid = ", ".join(repr(k) for k in table)
        raise ValueError(f"unknown {what} {key!r}; valid {what}s: {valid}") from None


def _require_same_shape(**tensors: torch.Tensor) -> None:
    # Broadcasting a [B] against a [B, T] silently yields a wrong [B, B]-ish result, so refuse it.
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


# --------------------------------------------------------------------------- masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is nonzero.

    x, mask: same shape (e.g. [B, T]); mask is 0/1 float or bool.
    dim=None returns a 0-dim tensor; an int reduces only that dimension. Units of ``x``.
    """
    _require_same_shape(x=x, mask=mask)
    # where() rather than x * mask: padding may hold inf/nan, and inf * 0 is nan.
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero.

    x, mask: same shape; dim=None returns a 0-dim tensor, an int reduces that dimension.
    An all-masked slice has mean 0 (not nan), so empty rows cannot poison a batch mean.
    Units of ``x``.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked positions, as a 0-dim tensor (units of ``x`` squared).

    x, mask: same shape. ``unbiased`` applies Bessel's correction n / (n - 1).
    Raises ValueError when there are too few masked elements for the estimate to exist
    (0, or 1 when unbiased), because a silent 0/nan would corrupt whitening downstream.
    """
    count = int(mask.bool().sum())
    if count == 0 or (unbiased and count == 1):
        raise ValueError(f"masked_var needs {'2' if unbiased else '1'}+ masked elements, got {count}")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        var = var * (count / (count - 1))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit (unbiased) variance over masked positions.

    x, mask: same shape (e.g. [B, T]); returns the same shape, dimensionless.
    With ``shift_mean=False`` only the scale changes and the original mean is kept, which
    preserves the sign of e.g. rewards. Positions with mask 0 are 0 in the output.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- advantages, rewards


def compute_gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over response tokens.

    token_rewards, values, response_mask: [B, T]; real tokens are a contiguous prefix of
    each row. The value after the last real token is bootstrapped as 0 (the episode ends).
    Returns (advantages, returns), both [B, T], in reward units; returns = advantages +
    values. Both are 0 where the mask is 0. Outputs are detached: they are regression and
    policy-gradient targets, never something to backpropagate through.
    """
    _require_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    keep = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(keep, token_rewards.detach(), zero)
    vals = torch.where(keep, values.detach(), zero)
    keep_f = keep.to(values.dtype)

    num_tokens = values.shape[-1]
    advantages_reversed = []
    next_advantage = torch.zeros_like(vals[:, 0])
    for t in reversed(range(num_tokens)):
        # "Next token is real" gates both the bootstrap value and the recursion, so the
        # return is cut off exactly at the end of each row's response.
        next_is_real = keep_f[:, t + 1] if t + 1 < num_tokens else torch.zeros_like(next_advantage)
        next_value = vals[:, t + 1] if t + 1 < num_tokens else torch.zeros_like(next_advantage)
        delta = rewards[:, t] + gamma * next_value * next_is_real - vals[:, t]
        next_advantage = delta + gamma * lam * next_is_real * next_advantage
        advantages_reversed.append(next_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    advantages = torch.where(keep, advantages, zero)
    returns = torch.where(keep, advantages + vals, zero)
    return advantages, returns


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


# Each takes log(pi/pi_ref) per token and returns a per-token KL(pi || pi_ref) estimate.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
    "abs": _kl_abs,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference), in nats.

    logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens.
    kind: a key of ``KL_ESTIMATORS`` -- "k1" logp - ref, "k2" 0.5 (logp - ref)^2,
    "k3" exp(ref - logp) - (ref - logp) - 1 (log-ratio clamped to [-20, 20]), "abs" |logp - ref|.
    Returns [B, T], unmasked. Unknown kind raises ValueError listing the valid kinds.
    """
    estimator = _pick(KL_ESTIMATORS, kind, "KL kind")
    _require_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return estimator(logprobs - ref_logprobs)


def compute_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token PPO reward: -kl_coef * kl on every response token, plus the sequence score
    added on the last real response token of each row.

    scores: [B] reward-model score per sequence; kl, response_mask: [B, T] (mask is a
    contiguous prefix per row). Returns [B, T] in reward units, 0 where the mask is 0.
    Raises ValueError if a row has no response token, since its score would be lost.
    """
    _require_same_shape(kl=kl, response_mask=response_mask)
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"scores must be [B]={tuple(kl.shape[:1])}, got {tuple(scores.shape)}")
    lengths = response_mask.bool().sum(dim=-1)
    if bool((lengths == 0).any()):
        raise ValueError("every row needs at least one response token to carry its score")
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(response_mask.bool(), -kl_coef * kl, zero)
    last_index = (lengths - 1).unsqueeze(-1)
    return rewards.scatter_add(-1, last_index, scores.to(kl.dtype).unsqueeze(-1))


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
    _require_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
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
    _require_same_shape(values=values, old_values=old_values, returns=returns)
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
    aggregation = _pick(LOSS_AGGREGATIONS, mode, "loss aggregation mode")
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
    _pick(LOSS_AGGREGATIONS, mode, "loss aggregation mode")
    if mode == "token-mean":
        return masked_sum(per_token, mask), float(mask.bool().sum())
    per_row = (
        masked_sum(per_token, mask, dim=-1) if mode == "seq-mean-token-sum" else masked_mean(per_token, mask, dim=-1)
    )
    return per_row.sum(), float(per_token.shape[0])


# --------------------------------------------------------------------------- logits, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position, in nats.

    logits: [B, T, V] (any float dtype; computed in float32). Returns [B, T] float32.
    Logits of -inf (banned tokens) are allowed and contribute 0.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    # A -inf log-prob times its 0 probability is nan; flooring to the finite minimum keeps the
    # product (and its gradient) at 0.
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability (nats) of ``token_ids`` under softmax(``logits``).

    logits: [B, T, V]; token_ids: [B, T] integer ids. Returns [B, T] float32; bf16/fp16
    logits are upcast first because low-precision log_softmax visibly biases the ratio r.
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over masked positions (0-dim, dimensionless).

    values, returns, mask: [B, T]. 1 is a perfect critic, 0 no better than a constant, < 0
    worse. nan when Var(returns) is 0 (the ratio is undefined). Biased variances are used;
    the correction cancels in the ratio.
    """
    _require_same_shape(values=values, returns=returns, mask=mask)
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values, mask, unbiased=False)
    return 1.0 - var_residual / var_returns


def distinct_n(token_lists: Sequence[Sequence[Hashable]], n: int = 2) -> float:
    """Pooled distinct-n: unique n-grams over all sequences / total n-grams (a fraction in
    [0, 1]; 0.0 when there are no n-grams). Items may be any hashable (words or token ids).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    unique: set[tuple] = set()
    total = 0
    for tokens in token_lists:
        tokens = list(tokens)
        for start in range(len(tokens) - n + 1):
            unique.add(tuple(tokens[start : start + n]))
            total += 1
    return len(unique) / total if total else 0.0


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
    controller_cls = _pick(KL_CONTROLLERS, kind, "KL controller kind")
    if controller_cls is FixedKLController:
        return FixedKLController(init_coef)
    return AdaptiveKLController(init_coef, target, horizon)
