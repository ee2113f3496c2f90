"""Scoring answers with models: what an evaluation or an RL step scores with, and reward-model
scores normalised by the statistics of a fixed reference set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.rollout.generate import RolloutBatch, batched_scores


@dataclass(frozen=True)
class ScoringModels:
    """What an evaluation scores answers with. Reward scores are normalised by score_norm."""

    reward_model: torch.nn.Module | None  # None: the round trains no reward model (eval/rm_score absent)
    score_norm: tuple[float, float] | None  # (mean, std) of raw scores on the fixed reference set
    reference: torch.nn.Module  # PPO's KL anchor
    sft: torch.nn.Module  # the SFT policy, for eval/kl_to_sft
    gold: Callable[..., Any]


def normalised_scores(
    reward_model: torch.nn.Module, batch: RolloutBatch, score_norm: tuple[float, float], chunk: int = 64
) -> torch.Tensor:
    mean, std = score_norm
    return (batched_scores(reward_model, batch, chunk) - mean) / std
