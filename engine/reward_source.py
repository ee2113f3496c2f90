"""Where PPO's scores come from: the reward model, or a rule once the reward source has failed.

The reward model's scores are normalised by its (mean, std) on the reward-model stage's fixed
reference set. Under ``reward.on_failure=fallback_rule`` a failure switches the rest of the stage
to ``reward.fallback_rule.fn`` (score signature of gold.fn: ``(prompt, response, **fields)`` ->
float or {"score": ...}). The rule's raw scores are standardised with the mean and std of the
first batch it scores, then frozen (and kept in the checkpoint meta): the same zero-mean,
unit-spread scale as the reward model's scores, so the KL coefficient keeps its weight against
the reward, and fixed numbers, so rewards stay comparable from step to step and across a resume.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlflow.engine import dist
from rlflow.engine.config import FunctionRef
from rlflow.engine.data import PromptRecord
from rlflow.engine.errors import RewardSourceError
from rlflow.engine.evaluation import normalised_scores
from rlflow.engine.faults import armed
from rlflow.engine.rollout import RolloutBatch
from rlflow.engine.scoring import load_function, score_answers

FALLBACK_METRIC = "reward/fallback_active"
_MIN_STD = 1e-6  # a rule that scored the whole first batch alike: no spread to divide by (std 1)


@dataclass(frozen=True)
class FallbackState:
    """The active fallback rule and its frozen normalisation (None until its first batch)."""

    fn: str
    mean: float | None = None
    std: float | None = None


class RewardSource:
    """PPO's reward. ``model_scores`` per rollout chunk, ``settle`` once all chunks are scored
    (every rank agrees whether the source failed), ``final_scores`` on the gathered batch."""

    def __init__(
        self,
        reward_model: torch.nn.Module,
        score_norm: tuple[float, float],
        rule: FunctionRef | None,
        fallback: FallbackState | None = None,
    ):
        self.reward_model, self.score_norm, self.rule = reward_model, score_norm, rule
        self.fallback = fallback  # set: the reward model failed earlier in this stage (or before a resume)
        self._failure: str | None = None
        fn = None if rule is None else load_function(rule.fn, "reward.fallback_rule.fn")  # fails before training
        self._rule_fn: Callable[..., Any] | None = None if fn is None else functools.partial(fn, **rule.kwargs)

    def model_scores(self, batch: RolloutBatch, rows: int, step: int) -> torch.Tensor:
        """Normalised reward-model scores of one chunk; placeholders once the fallback is active
        (the failed source is not asked again: the rule scores the gathered batch instead)."""
        if self.fallback is not None:
            return torch.zeros(rows)
        scores = normalised_scores(self.reward_model, batch, self.score_norm, rows)
        # Decided after the forward pass: every rank runs the same collectives (ZeRO-3) either way.
        if not bool(torch.isfinite(scores).all()):  # e.g. an overflow in a low-precision reward model
            bad = int((~torch.isfinite(scores)).sum())
            self._failure = f"the reward model returned {bad} non-finite score(s) of {rows} at step {step}"
        if armed("ppo", "reward_error", step):
            self._failure = f"reward source error injected at step {step} (RLFLOW_FAULT)"
        return scores

    def settle(self) -> None:
        """Raise RewardSourceError on every rank if the source failed on any rank this step."""
        failure, self._failure = self._failure, None
        failed = int(failure is not None)
        if dist.world_size() > 1:
            failed = dist.all_reduce_max(failed)
        if failed:
            raise RewardSourceError(failure or "the reward source failed on another rank")

    def activate_fallback(self) -> str:
        """Switch to the rule for the rest of the stage; returns its name."""
        if self.rule is None:
            raise RewardSourceError("reward.on_failure=fallback_rule needs reward.fallback_rule.fn")
        self.fallback = FallbackState(self.rule.fn)
        return self.rule.fn

    def final_scores(
        self, scores: torch.Tensor, records: Sequence[PromptRecord] | None, texts: Sequence[str]
    ) -> torch.Tensor:
        """The batch's scores [B]: the reward model's as given, or the rule's, normalised."""
        if self.fallback is None:
            return scores
        if records is None or self._rule_fn is None:
            raise RewardSourceError("the fallback rule needs the batch's prompt records")
        raw = None
        if dist.is_main():  # one caller, like the gold function: every rank gets the same numbers
            raw = score_answers(self._rule_fn, [r.prompt for r in records], list(texts), [r.fields for r in records])
            raw = raw.scores
        raw = dist.all_gather_json(raw)[0] if dist.is_distributed() else raw
        if self.fallback.mean is None:
            mean = sum(raw) / len(raw)
            std = math.sqrt(sum((s - mean) ** 2 for s in raw) / max(1, len(raw) - 1))
            self.fallback = FallbackState(self.fallback.fn, mean, std if std > _MIN_STD else 1.0)
        return (torch.tensor(raw, dtype=scores.dtype) - self.fallback.mean) / self.fallback.std
