"""Masked statistics and token-level quantities, as pure functions (tensors in, tensors out).

Shape conventions used throughout engine.algorithms:
    B = batch size (sequences), T = response length (right-padded), V = vocabulary size.
    ``response_mask`` / ``mask`` is [B, T], 1 (or True) on real response tokens, 0 on padding.
Log-probabilities are natural logs (nats).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "distinct_n",
    "entropy_from_logits",
    "explained_variance",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pick_variant",
    "require_same_shape",
]

# exp(20) ~ 4.9e8 is far beyond any ratio PPO can use, yet exp of it stays finite in fp32.
LOG_RATIO_CLAMP = 20.0


def pick_variant(table: dict, key: str, what: str):
    try:
        return table[key]
    except KeyError:
        valid = ", ".join(repr(k) for k in table)
        raise ValueError(f"unknown {what} {key!r}; valid {what}s: {valid}") from None


def require_same_shape(**tensors: torch.Tensor) -> None:
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
    require_same_shape(x=x, mask=mask)
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
    require_same_shape(values=values, returns=returns, mask=mask)
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


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """The mean of n numbers and its standard error, sqrt(sample variance / n) (0.0 for n = 1)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_and_stderr of no values")
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(1, n - 1)
    return mean, math.sqrt(var / n)


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """Mean of after[i] - before[i] over the same n items (prompts) and its standard error.

    Pairing removes the spread between prompts from the noise, so a small real change on the same
    prompts stands out where two independent means' standard errors would hide it."""
    if len(before) != len(after):
        raise ValueError(f"paired_difference needs the same items: {len(before)} before, {len(after)} after")
    return mean_and_stderr([b - a for a, b in zip(before, after)])


def sign_agreement(
    before_a: Sequence[float], after_a: Sequence[float], before_b: Sequence[float], after_b: Sequence[float]
) -> tuple[float | None, int]:
    """How often two scorers agree on which of two answers to the same item is better.

    Over the items both scorers tell apart (after - before nonzero for each), the share where the
    two changes have the same sign, and the number of such items; (None, 0) when there is none.
    """
    sizes = {len(before_a), len(after_a), len(before_b), len(after_b)}
    if len(sizes) != 1:
        raise ValueError(f"sign_agreement needs the same items from both scorers, got lengths {sorted(sizes)}")
    pairs = [(a1 - a0, b1 - b0) for a0, a1, b0, b1 in zip(before_a, after_a, before_b, after_b)]
    told_apart = [(da > 0) == (db > 0) for da, db in pairs if da != 0 and db != 0]
    return (sum(told_apart) / len(told_apart) if told_apart else None), len(told_apart)
