"""Scoring answers with models: what an evaluation or an RL step scores with, and reward-model
scores normalised by the statistics of a fixed reference set.

An ensemble reward model (rm.ensemble) scores each answer once per head; each head is normalised
by its own statistics (Bradley-Terry fixes a head's scores only up to an offset and a scale, so
raw heads are not comparable), and the ensemble's score is the mean of the normalised heads,
its uncertainty their standard deviation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.models.loading import head_columns
from rlflow.engine.rollout.generate import RolloutBatch, batched_scores

# (mean, std) of raw scores on the fixed reference set: floats for one head, one per head for an ensemble.
ScoreNorm = tuple[float, float] | tuple[tuple[float, ...], tuple[float, ...]]


@dataclass(frozen=True)
class ScoringModels:
    """What an evaluation scores answers with. Reward scores are normalised by score_norm."""

    reward_model: torch.nn.Module | None  # None: the round trains no reward model (eval/rm_score absent)
    score_norm: ScoreNorm | None  # (mean, std) of raw scores on the fixed reference set
    reference: torch.nn.Module  # PPO's KL anchor
    sft: torch.nn.Module  # the SFT policy, for eval/kl_to_sft
    gold: Callable[..., Any]
    valid: Callable[..., float] | None = None  # reward.valid: (prompt, response, **fields) -> 1 or 0; None: gold
    # reward.judge: a rule or function (prompt, response, **fields) -> float, or a second reward model
    # (its raw scores, the mean of its heads); both None: no judge (eval/judge_* absent)
    judge: Callable[..., float] | None = None
    judge_model: torch.nn.Module | None = None


def normalised_head_scores(
    reward_model: torch.nn.Module, batch: RolloutBatch, score_norm: ScoreNorm, chunk: int = 64
) -> torch.Tensor:
    """[B, H] scores, head h normalised by (mean_h, std_h); H = 1 for a one-head reward model."""
    mean, std = (torch.as_tensor(x, dtype=torch.float32) for x in score_norm)
    return (head_columns(batched_scores(reward_model, batch, chunk)) - mean) / std


def ensemble_mean_std(head_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [B] and standard deviation [B] (unbiased) over the H heads of [B, H] scores; the
    deviation is 0 for one head (no ensemble, no spread)."""
    if head_scores.shape[1] == 1:
        return head_scores[:, 0], torch.zeros_like(head_scores[:, 0])
    return head_scores.mean(1), head_scores.std(1)


def penalised_scores(head_scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """The uncertainty-penalised reward [B] of [B, H] head scores: mean - penalty x std."""
    mean, std = ensemble_mean_std(head_scores)
    return mean - penalty * std


def normalised_scores(
    reward_model: torch.nn.Module, batch: RolloutBatch, score_norm: ScoreNorm, chunk: int = 64
) -> torch.Tensor:
    """[B] normalised scores: an ensemble's mean over its heads."""
    return ensemble_mean_std(normalised_head_scores(reward_model, batch, score_norm, chunk))[0]
