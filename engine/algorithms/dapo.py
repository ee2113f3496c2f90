"""DAPO's two batch-level rules (Yu et al. 2025), as pure functions: the soft overlong penalty and
the groups that dynamic sampling keeps.

Both are about what a batch teaches. An answer cut off at the length limit is not wrong for its
content but for its length, so its penalty ramps in over a buffer instead of a cliff; and a group
whose samples all scored the same has zero group-relative advantage, so it adds tokens to the
loss's normaliser and nothing to the gradient.
"""

from __future__ import annotations

import torch

from rlflow.engine.algorithms.advantages import GROUP_STD_EPS

__all__ = ["informative_groups", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [B], in reward units, for response lengths [B] (tokens):

        0                                            if L <= max_length - buffer
        -factor * (L - (max_length - buffer)) / buffer  if max_length - buffer < L <= max_length
        -factor                                      if L > max_length

    so an answer that uses the whole budget (a cut-off one) gets -factor. 0 < buffer <= max_length.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in 1..max_length={max_length} tokens, got {buffer}")
    start = max_length - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0, max=float(buffer))
    return -factor * over / buffer


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups of `group_size` consecutive samples have rewards that are not all equal: [B / n]
    bool, for scores [B]. Equal means a spread (max - min) within GROUP_STD_EPS, the tolerance under
    which the group estimators give a zero advantage."""
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of rollout.n={group_size} >= 2")
    grouped = scores.reshape(-1, group_size)
    return (grouped.max(-1).values - grouped.min(-1).values) > GROUP_STD_EPS
