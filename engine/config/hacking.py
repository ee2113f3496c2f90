"""The `hacking` section: the reward-hacking detector of the RL stage (engine/promotion/hacking.py)."""

from __future__ import annotations

from pydantic import Field

from rlflow.engine.config.base import Section


class HackingConfig(Section):
    enabled: bool = False
    """Watch each RL step's samples for reward hacking; on a divergence the round's RL stops and its
    candidate is the last checkpoint before the diverged window (docs/hacking.md)."""
    window: int = Field(5, ge=1)
    """Steps per window: the first window is the baseline, the last is compared with it (from step
    2 x window on). checkpoint.every_steps must not exceed it, so a checkpoint precedes every window."""
    min_judge_drop: float | None = Field(0.0, ge=0)
    """Diverged when the proxy rose while the window mean of the judge (reward.judge) fell more than
    this; None: off."""
    max_valid_drop: float | None = Field(0.1, ge=0)
    """Diverged when the valid share (of reward.valid, the declared valid rule) fell more than this
    below the baseline window's; None: off."""
    max_spread_ratio: float | None = Field(None, gt=1)
    """Diverged when the ensemble's spread (critic/score_std_ensemble, rm.ensemble >= 2) grew above
    this many times the baseline's; None: off."""
