"""The per-token value loss, and how per-token losses are averaged, as pure functions.

Per-token losses (this value loss, engine/algorithms/policy_losses.py's policy losses) are returned
unreduced; averaging is a separate, explicit choice made with ``aggregate_loss``
(LOSS_AGGREGATIONS). Shapes as in engine.algorithms.stats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.engine.algorithms.stats import masked_mean, masked_sum, pick_variant, require_same_shape

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


def _token_sums(per_token, mask, norm_length):
    return masked_sum(per_token, mask).unsqueeze(0)  # one "row": units are tokens (loss_sum_and_units)


def _row_sums(per_token, mask, norm_length):
    return masked_sum(per_token, mask, dim=-1)


def _row_means(per_token, mask, norm_length):
    return masked_mean(per_token, mask, dim=-1)


def _row_sums_over_length(per_token, mask, norm_length):
    return masked_sum(per_token, mask, dim=-1) / norm_length


# Each maps (per_token [B, T], mask [B, T], norm_length) to per-row shares [B] (token-mean: one
# total [1]) whose sum over the batch, divided by its units (tokens or rows), is the loss.
LOSS_AGGREGATIONS: dict[str, Callable] = {
    "token-mean": _token_sums,
    "seq-mean-token-sum": _row_sums,
    "seq-mean-token-mean": _row_means,
    "seq-mean-token-sum-norm": _row_sums_over_length,
}


def _shares(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None) -> torch.Tensor:
    aggregation = pick_variant(LOSS_AGGREGATIONS, mode, "loss aggregation mode")
    if (mode == "seq-mean-token-sum-norm") != (norm_length is not None):
        raise ValueError(f"norm_length is given with, and only with, mode 'seq-mean-token-sum-norm' (mode {mode!r})")
    if norm_length is not None and norm_length <= 0:
        raise ValueError(f"norm_length must be positive, got {norm_length}")
    return aggregation(per_token, mask, norm_length)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a 0-dim tensor over masked tokens.

    mode (a key of ``LOSS_AGGREGATIONS``):
        "token-mean": sum over masked tokens / (num_tokens if given else their count).
            Passing the global token count of all micro-batches makes the micro-batch
            losses sum to the token-mean of the whole batch.
        "seq-mean-token-sum": per-row sum over masked tokens, then mean over the B rows.
        "seq-mean-token-mean": per-row mean over masked tokens, then mean over the B rows
            (a row with no tokens contributes 0).
        "seq-mean-token-sum-norm": per-row sum over masked tokens divided by the constant
            `norm_length` (Dr. GRPO: the generation budget, so a token weighs the same in a short
            and a long answer and length brings no bias), then mean over the B rows.
    num_tokens only applies to "token-mean" and norm_length only (and always) to
    "seq-mean-token-sum-norm"; anything else raises ValueError rather than being silently ignored,
    as does an unknown mode.
    """
    shares = _shares(per_token, mask, mode, norm_length)
    if mode != "token-mean":
        if num_tokens is not None:
            raise ValueError(f"num_tokens only applies to mode 'token-mean', not {mode!r}")
        return shares.mean()
    if num_tokens is not None and not isinstance(num_tokens, torch.Tensor) and num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return shares.sum() / (mask.bool().sum().clamp(min=1) if num_tokens is None else num_tokens)


def loss_sum_and_units(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None
) -> tuple[torch.Tensor, float]:
    """A micro-batch's share of an aggregated loss: (sum, units) with aggregate = sum / units.

    per_token, mask: [B, T]. Summing the sums of all micro-batches and ranks and dividing by their
    summed units gives ``aggregate_loss`` of the whole batch: units are masked tokens for
    "token-mean", rows for the "seq-mean-*" modes. norm_length: as in ``aggregate_loss``.
    """
    shares = _shares(per_token, mask, mode, norm_length)
    return shares.sum(), loss_units(mask, mode)


def loss_units(mask: torch.Tensor, mode: str) -> float:
    """Units a loss over rows with response mask `mask` [B, T] is normalised by: masked tokens
    for "token-mean", rows for the "seq-mean-*" modes."""
    return float(mask.bool().sum()) if mode == "token-mean" else float(mask.shape[0])
