"""Where the RL stage's scores come from: `reward.sources` (learned reward models, rules and
functions, each weighted), or a rule once a learned reward model has failed.

A sample's score is sum_i weight_i x score_i. The round's reward model's scores are normalised
by its (mean, std) on the reward-model stage's fixed reference set; a reward model given by path
and the rules and functions give raw scores. Rules and functions run in a pool of worker
processes (engine/rewards/pool.py), submitted per sampled chunk so they overlap the sampling of
the next one. Under ``reward.on_failure=fallback_rule`` a failure switches the rest of the stage
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
from typing import TYPE_CHECKING, Any, Callable

import torch

from rlflow.engine.backend import dist
from rlflow.engine.config.methods import RewardConfig, RewardSourceConfig
from rlflow.engine.config.base import FunctionRef
from rlflow.engine.data.records import PromptRecord
from rlflow.engine.errors import RewardFunctionError, RewardSourceError
from rlflow.engine.rewards.model_scores import (
    ScoreNorm,
    ScoringModels,
    ensemble_mean_std,
    normalised_head_scores,
    penalised_scores,
)
from rlflow.engine.models.loading import load_scalar_model, model_kwargs
from rlflow.engine.faults import armed
from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.rewards.user_functions import load_function, score_answers

if TYPE_CHECKING:
    from rlflow.engine.rewards.pool import RewardFunctionPool

FALLBACK_METRIC = "reward/fallback_active"
_MIN_STD = 1e-6  # a rule that scored the whole first batch alike: no spread to divide by (std 1)


@dataclass(frozen=True)
class FallbackState:
    """The active fallback rule and its frozen normalisation (None until its first batch)."""

    fn: str
    mean: float | None = None
    std: float | None = None


@dataclass(frozen=True)
class LearnedSource:
    """A reward model as one weighted source; an ensemble's score is its heads' mean less
    `penalty` x their std, and that std's batch mean is logged as `std_metric`."""

    name: str
    weight: float
    model: torch.nn.Module
    score_norm: ScoreNorm  # (mean, std) its raw scores are normalised by; (0, 1): raw
    penalty: float = 0.0  # reward.uncertainty_penalty
    std_metric: str = ""  # critic/score_std_ensemble for the round's reward model

    def scores(self, batch: RolloutBatch, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b] scores of one chunk, and the heads' std [b] (None: one head)."""
        heads = normalised_head_scores(self.model, batch, self.score_norm, rows)
        std = ensemble_mean_std(heads)[1] if heads.shape[1] > 1 else None
        return penalised_scores(heads, self.penalty), std


class RewardSource:
    """The RL stage's reward. Per sampled chunk: ``model_scores`` (learned sources, now) and
    ``submit`` (rules and functions, in the pool); once all chunks are sampled: ``collect`` each
    submission, then ``settle`` (every rank agrees whether a source failed); ``final_scores`` on
    the gathered [B, S] matrix of per-source scores (learned sources first, in config order)."""

    def __init__(
        self,
        learned: Sequence[LearnedSource],
        rule: FunctionRef | None,
        fallback: FallbackState | None = None,
        pool: RewardFunctionPool | None = None,
        pool_weights: dict[str, float] | None = None,
    ):
        self.learned, self.rule, self.pool = tuple(learned), rule, pool
        self.pool_weights = dict(pool_weights or {})
        self.names = [s.name for s in self.learned] + list(self.pool_weights)
        self.weights = torch.tensor([s.weight for s in self.learned] + list(self.pool_weights.values()))
        self.fallback = fallback  # set: a reward model failed earlier in this stage (or before a resume)
        self.metrics: dict[str, float] = {}  # per-source means of the last final_scores
        self._failure: str | None = None
        self._function_failure: str | None = None
        self._skipped: dict[str, int] = {}
        self._spread: dict[str, torch.Tensor] = {}  # std metric -> [sum, count] of this rank's chunks
        fn = None if rule is None else load_function(rule.fn, "reward.fallback_rule.fn")  # fails before training
        self._rule_fn: Callable[..., Any] | None = None if fn is None else functools.partial(fn, **rule.kwargs)

    def model_scores(self, batch: RolloutBatch, rows: int, step: int) -> torch.Tensor:
        """[b, S_learned] scores of one chunk by the learned sources; placeholders once the fallback
        is active (the failed source is not asked again: the rule scores the gathered batch)."""
        if self.fallback is not None:
            return torch.zeros(rows, len(self.learned))
        columns = []
        for source in self.learned:
            column, std = source.scores(batch, rows)
            columns.append(column)
            if std is not None:
                total = self._spread.setdefault(source.std_metric, torch.zeros(2, dtype=torch.float64))
                total += torch.tensor([float(std.sum()), std.numel()], dtype=torch.float64)
        scores = torch.stack(columns, dim=1) if columns else torch.zeros(rows, 0)
        # Decided after the forward pass: every rank runs the same collectives (ZeRO-3) either way.
        if not bool(torch.isfinite(scores).all()):  # e.g. an overflow in a low-precision reward model
            bad = int((~torch.isfinite(scores)).any(dim=1).sum())
            self._failure = f"the reward model returned {bad} non-finite score(s) of {rows} at step {step}"
        if armed("rl", "reward_error", step):
            self._failure = f"reward source error injected at step {step} (RLFLOW_FAULT)"
        return scores

    def submit(self, batch: RolloutBatch, records: Sequence[PromptRecord]) -> Any:
        """Hand one chunk to the rule and function sources (returns at once); None without any."""
        if self.pool is None or self.fallback is not None:
            return None
        return self.pool.submit([r.prompt for r in records], list(batch.response_texts), [r.fields for r in records])

    def collect(self, handle: Any, rows: int) -> torch.Tensor:
        """[b, S_functions] scores of a submitted chunk (zeros after a failure, which settle raises)."""
        if handle is None:
            return torch.zeros(rows, len(self.pool_weights))
        try:
            result = handle.result()
        except RewardSourceError as exc:  # reward.on_error=fail: the pool named the source and sample
            self._function_failure = self._function_failure or str(exc)
            return torch.zeros(rows, len(self.pool_weights))
        for name, count in result.skipped.items():
            self._skipped[name] = self._skipped.get(name, 0) + count
        return torch.tensor([result.scores[name] for name in self.pool_weights], dtype=torch.float32).T.reshape(
            rows, len(self.pool_weights)
        )

    def settle(self) -> None:
        """Raise on every rank if a source failed on any rank this step: RewardFunctionError for a
        rule or function (reward.on_error=fail), RewardSourceError for a reward model."""
        failure, self._failure = self._failure, None
        function_failure, self._function_failure = self._function_failure, None
        failed = 2 if function_failure is not None else int(failure is not None)
        if dist.world_size() > 1:
            failed = dist.all_reduce_max(failed)
        if failed == 2:
            raise RewardFunctionError(
                f"{function_failure or 'a reward function failed on another rank'}; fix the function, or set"
                " reward.on_error=skip to score such samples 0 and count them"
            )
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
        """The batch's scores [B] from the per-source matrix `scores` [B, S]: their weighted sum, or
        the fallback rule's scores, normalised. Sets ``metrics`` (reward/<name>/mean, /skipped)."""
        if self.fallback is None:
            self.metrics = {f"reward/{n}/mean": float(scores[:, i].mean()) for i, n in enumerate(self.names)}
            if self.pool_weights:
                counts = [float(self._skipped.get(n, 0)) for n in self.pool_weights]
                skipped = dist.all_reduce_sum(torch.tensor(counts))
                self.metrics |= {f"reward/{n}/skipped": float(skipped[i]) for i, n in enumerate(self.pool_weights)}
            self._skipped = {}
            for metric, (total, count) in ((m, dist.all_reduce_sum(t)) for m, t in sorted(self._spread.items())):
                self.metrics[metric] = float(total / count) if count else float("nan")
            self._spread = {}
            return (scores * self.weights.to(scores.dtype)).sum(dim=1)
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
        self.metrics = {}
        return (torch.tensor(raw, dtype=scores.dtype) - self.fallback.mean) / self.fallback.std


def source_scorer(source: RewardSourceConfig | None, on_error: str) -> Callable[..., float] | None:
    """The scorer of a rule or function source (reward.valid, reward.judge) as
    `(prompt, response, **fields) -> float`, built as the pool builds it, for the evaluations to call
    in process; None for no source or a reward model (the evaluation loads that)."""
    from rlflow.engine.rewards.pool_worker import build_scorer, source_spec

    if source is None or source.type == "model":
        return None
    scorer = build_scorer(source_spec(source, on_error))
    return lambda prompt, response, **fields: scorer(prompt, response, fields)


def named_source(reward: RewardConfig, name: str | None) -> RewardSourceConfig | None:
    """The reward source called `name` (reward.valid, reward.judge); None for None."""
    return next((s for s in reward.sources if s.name == name), None)


def start_reward_pool(reward: RewardConfig) -> RewardFunctionPool | None:
    """The worker pool of the rule and function sources (None without any): each is checked
    (imports, arguments) before any step runs."""
    sources = [s for s in reward.sources if s.type != "model"]
    if not sources:
        return None
    from rlflow.engine.rewards.pool import RewardFunctionPool

    return RewardFunctionPool(sources, workers=reward.workers, timeout_s=reward.timeout_s, on_error=reward.on_error)


def build_reward_source(
    reward: RewardConfig,
    scoring: ScoringModels,
    fallback_rule: FunctionRef | None,
    pool: RewardFunctionPool | None,
    runtime: Any,
    model_cfg: Any,
) -> RewardSource:
    """The RL stage's RewardSource: `scoring.reward_model` (the round's, normalised by its
    score_norm; an ensemble less reward.uncertainty_penalty x its spread) for a model source without
    a path, a frozen reward model loaded from `path` (raw scores; an ensemble as the mean of its
    heads) for one with a path, and the pool's rules and functions."""
    learned = []
    for s in reward.sources:
        if s.type != "model":
            continue
        if s.path is None:
            if scoring.reward_model is None:
                raise RewardSourceError(f"reward source {s.name!r} is the round's reward model, but none was trained")
            model, norm, penalty = scoring.reward_model, scoring.score_norm, reward.uncertainty_penalty
            learned.append(LearnedSource(s.name, s.weight, model, norm, penalty, "critic/score_std_ensemble"))
        else:
            kw = model_kwargs(model_cfg)
            # Scored raw, so an ensemble's heads (each with an offset of its own) count as their mean.
            key = f"reward.sources[{s.name}].path"
            model = runtime.frozen(lambda p=s.path, k=key: load_scalar_model(p, key=k, heads=1, **kw))
            learned.append(LearnedSource(s.name, s.weight, model, (0.0, 1.0)))
    weights = {s.name: s.weight for s in reward.sources if s.type != "model"}
    return RewardSource(learned, fallback_rule, pool=pool, pool_weights=weights)
