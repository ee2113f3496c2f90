"""How a policy is sampled: the `sampling` section (temperature, top-p, new tokens) that the RL
stage's rollouts, online labelling and evaluation share, and the SamplingParams record they take."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from rlflow.engine.config.base import Section


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy (evaluation only; PPO's ratio needs a distribution)
    top_p: float = 1.0
    max_new_tokens: int = 24


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of rollouts, online labelling and evaluation (unless eval.greedy); the RL
    stage's log-probabilities are of the policy at this temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling's top-p (rollouts, labelling and evaluation, unless eval.greedy)."""
    max_new_tokens: int = Field(24, ge=1)
    """Most tokens per sampled response (rollouts, labelling and evaluation)."""

    def params(self, greedy: bool = False) -> SamplingParams:
        """The record the samplers take; greedy: temperature 0 with this max_new_tokens."""
        if greedy:
            return SamplingParams(0.0, 1.0, self.max_new_tokens)
        return SamplingParams(self.temperature, self.top_p, self.max_new_tokens)
