"""From sampled responses to PPO experience: the timed scoring passes over each sampled chunk,
then the pure assembly of KL-penalised token rewards, GAE advantages and returns.

Scoring runs per chunk of `rollout.generate_batch` prompts, right after that chunk is sampled; the
policy's own log-probs and the critic's values can be left to the update (`from_update`), when
its first forward runs on exactly the weights that sampled (engine/stages/rl/step.py, single_pass_update).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from rlflow.engine.backend import dist
from rlflow.engine.algorithms.advantages import compute_advantages
from rlflow.engine.algorithms.dapo import overlong_penalty
from rlflow.engine.algorithms.kl import behaviour_weighted_kl, compute_token_rewards, token_kl
from rlflow.engine.algorithms.rollout_correction import correction_metrics, importance_weights, raw_importance_weights
from rlflow.engine.algorithms.stats import explained_variance, masked_mean, masked_whiten
from rlflow.engine.backend.runtime import Runtime, TrainEngine
from rlflow.engine.config.stages import RLConfig
from rlflow.engine.rewards.model_scores import ScoringModels, normalised_scores
from rlflow.engine.faults import fault_point
from rlflow.engine.rollout.generate import (
    RolloutBatch,
    batched_logprobs,
    batched_values,
    generate_rollouts,
    merge_rollouts,
    pad_responses,
)
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.lookahead import chunk_spans
from rlflow.engine.rollout.episodes import EpisodeSampler
from rlflow.engine.rollout.service import RolloutService
from rlflow.engine.seeds import step_seed
from rlflow.engine.telemetry.phases import add_phases, timed

if TYPE_CHECKING:
    from rlflow.engine.data.records import PromptRecord
    from rlflow.engine.rewards.sources import RewardSource
    from rlflow.engine.stages.rl.inputs import RLInputs


@dataclass(frozen=True)
class Objective:
    """What the RL update optimises: the advantage estimator (algorithm.name) and its parameters,
    the group size (rollout.n samples per prompt), where the KL to the reference goes (reward or
    loss) and how, the sampled policy (its temperature defines the log-probabilities) and PPO's
    critic loss."""

    estimator: str = "ppo"  # a key of engine/algorithms/advantages.py ADVANTAGE_ESTIMATORS
    group_size: int = 1
    kl_in_loss: bool = False  # True: kl_loss_coef x kl_estimator in the actor loss, none in the reward
    kl_estimator: str = "k1"  # a key of engine/algorithms/kl.py KL_ESTIMATORS, resolved from kl.*
    kl_loss_coef: float = 0.0
    norm_std: bool = True  # GRPO: divide by the group's std
    sampling: SamplingParams = SamplingParams()
    policy_loss: str = "ppo"  # a key of engine/algorithms/policy_losses.py POLICY_LOSSES
    rollout_correction: str = "none"  # a key of engine/algorithms/rollout_correction.py CORRECTIONS
    correction_cap: float = 2.0
    correction_level: str = "token"  # or "sequence"
    overlong_buffer: int | None = None  # DAPO's soft overlong penalty (tokens); None: off
    overlong_penalty: float = 1.0  # reward units, at the length limit
    dynamic_sampling_max_tries: int | None = None  # DAPO's dynamic sampling; None: off
    off_policy: bool = False  # rollout.off_policy_steps > 0 or async: samples come from an older policy
    lam: float = 0.95  # GAE's lambda (ppo.lam)
    whiten_advantages: bool = True  # PPO's GAE advantages whitened over the batch (ppo.whiten_advantages)
    value_clip: float = 0.2  # the critic's value clip (ppo.value_clip)
    critic_warmup_steps: int = 0  # first steps in which only the critic learns (ppo.critic_warmup_steps)

    @classmethod
    def of(cls, inputs: RLInputs) -> Objective:
        """The objective an RL stage's inputs define (its algorithm, kl, sampling, rollout, reward and ppo sections)."""
        algorithm, kl, ppo = inputs.algorithm, inputs.kl, inputs.ppo
        in_loss = kl.placed_in_loss(algorithm.name)
        critic = {} if ppo is None else {
            "lam": ppo.lam, "whiten_advantages": ppo.whiten_advantages, "value_clip": ppo.value_clip,
            "critic_warmup_steps": ppo.critic_warmup_steps,
        }
        return cls(
            estimator=algorithm.name,
            group_size=inputs.rollout.n,
            kl_in_loss=in_loss,
            kl_estimator=kl.estimator_for(in_loss),
            kl_loss_coef=kl.loss_coef,
            norm_std=algorithm.norm_std,
            sampling=inputs.sampling.params(),
            policy_loss=algorithm.policy_loss,
            rollout_correction=algorithm.rollout_correction,
            correction_cap=algorithm.correction_cap,
            correction_level=algorithm.correction_level,
            overlong_buffer=inputs.reward.overlong_buffer,
            overlong_penalty=inputs.reward.overlong_penalty,
            dynamic_sampling_max_tries=algorithm.dynamic_sampling_max_tries if algorithm.dynamic_sampling else None,
            off_policy=inputs.rollout.samples_ahead,
            **critic,
        )

    def shaped_scores(self, scores: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
        """The rollout's scores [B] plus DAPO's overlong penalty of each response, if configured."""
        if self.overlong_buffer is None:
            return scores
        lengths, budget = batch.response_mask.sum(-1), self.sampling.max_new_tokens
        return scores + overlong_penalty(lengths, budget, self.overlong_buffer, self.overlong_penalty)

    def raw_importance_weights(self, old_logprobs: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
        """pi_old / pi_sampler [B, R] of the batch's tokens at this objective's correction level."""
        if batch.sampled_logprobs is None:
            raise ValueError("this rollout carries no sampler log-probs (RolloutBatch.sampled_logprobs)")
        return raw_importance_weights(old_logprobs, batch.sampled_logprobs, batch.response_mask, self.correction_level)


@dataclass(frozen=True)
class RLModels:
    actor: TrainEngine
    critic: TrainEngine | None  # None: a critic-free estimator (GRPO, RLOO, REINFORCE++)
    tokenizer: Any
    scoring: ScoringModels  # reward model, reference, SFT policy, gold (evaluation only)
    runtime: Runtime
    rollout: RolloutService | None = None  # rollout.mode=server: samples come from rollout replicas
    reward: RewardSource | None = None  # None: the reward model alone (no failure handling, as in evaluation)
    episodes: EpisodeSampler | None = None  # env: rollouts and evaluations are multi-turn episodes


@dataclass(frozen=True)
class ScoredRollout:
    """A sampled batch with what the frozen models said about it. B rows, R response tokens."""

    batch: RolloutBatch
    ref_logprobs: torch.Tensor  # [B, R] reference log-probs
    scores: torch.Tensor  # [B] the weighted sum of the reward sources (or the fallback rule's score)
    old_logprobs: torch.Tensor | None  # [B, R] policy log-probs at sampling time; None: the update computes them
    values: torch.Tensor | None  # [B, R] critic values at sampling time; None: the update computes them

    def rows(self, index: torch.Tensor) -> ScoredRollout:
        """The rows `index` [M], at the same widths."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        batch, ref, scores = self.batch.rows(index), self.ref_logprobs[index], self.scores[index]
        return ScoredRollout(batch, ref, scores, pick(self.old_logprobs), pick(self.values))

    @staticmethod
    def concat(parts: Sequence[ScoredRollout], pad_id: int) -> ScoredRollout:
        """Rows of `parts` in order, re-padded to common widths (merge_rollouts)."""
        if len(parts) == 1:
            return parts[0]
        joined = lambda ts: None if ts[0] is None else pad_responses(ts)  # noqa: E731
        return ScoredRollout(
            merge_rollouts([p.batch for p in parts], pad_id),
            pad_responses([p.ref_logprobs for p in parts]),
            torch.cat([p.scores for p in parts]),
            joined([p.old_logprobs for p in parts]),
            joined([p.values for p in parts]),
        )


@dataclass(frozen=True)
class Experience:
    """A scored rollout, ready for updates. B rows, R response tokens."""

    batch: RolloutBatch
    old_logprobs: torch.Tensor  # [B, R] policy log-probs at sampling time
    ref_logprobs: torch.Tensor  # [B, R] reference log-probs
    values: torch.Tensor  # [B, R] critic values at sampling time (zeros without a critic)
    scores: torch.Tensor  # [B] reward of each sample (sum over the reward sources, weighted; + overlong penalty)
    token_rewards: torch.Tensor  # [B, R] -kl_coef * KL per token (KL in the reward), + score at the last token
    advantages: torch.Tensor  # [B, R] by the objective's estimator (PPO: GAE, whitened if configured)
    returns: torch.Tensor  # [B, R] returns (PPO: the critic's targets)
    is_weights: torch.Tensor | None = None  # [B, R] rollout-correction weight of each token's loss; None: none


@torch.no_grad()
def _score_chunk(
    models: RLModels,
    temperature: float,
    batch: RolloutBatch,
    step: int,
    from_update: bool,
) -> list[torch.Tensor | None]:
    """[old_logprobs, ref_logprobs, values] ([b, R] each, the first and last None if `from_update`;
    values zeros without a critic) and the chunk's scores: [b, S] per learned source with a
    RewardSource, else the reward model's normalised [b]."""
    rows, scoring = batch.input_ids.shape[0], models.scoring
    reward = models.reward
    old = (
        None
        if from_update
        else timed(
            "timing_s/old_logprobs",
            lambda: batched_logprobs(models.actor.forward, batch, temperature, rows),
        )
    )
    ref = timed("timing_s/ref", lambda: batched_logprobs(scoring.reference, batch, temperature, rows))
    if models.critic is None:
        values = torch.zeros_like(ref)
    elif from_update:
        values = None
    else:
        values = timed("timing_s/values", lambda: batched_values(models.critic.forward, batch, rows))
    scores = timed(
        "timing_s/reward",
        lambda: (
            reward.model_scores(batch, rows, step)
            if reward is not None
            else normalised_scores(scoring.reward_model, batch, scoring.score_norm, rows)
        ),
    )
    return [old, ref, values, scores]


def _gather_rollout(local: RolloutBatch, n: int, generate_batch: int, pad: int) -> RolloutBatch:
    """Every rank's chunks, in global order, prompts re-left-padded to the widest."""
    width = local.prompt_width

    def gather(t: torch.Tensor, value: float = 0.0, left: bool = False) -> torch.Tensor:
        return dist.gather_chunked(t, n, generate_batch, value, left)

    input_ids = torch.cat([gather(local.input_ids[:, :width], pad, True), gather(local.response_ids, pad)], 1)
    attention = torch.cat(
        [gather(local.attention_mask[:, :width], 0, True), gather(local.attention_mask[:, width:])], 1
    )
    response_mask = gather(local.response_mask)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response_mask,
        prompt_width=input_ids.shape[1] - response_mask.shape[1],
        response_texts=tuple(dist.gather_chunked_list(local.response_texts, n, generate_batch)),
        sampled_logprobs=None if local.sampled_logprobs is None else gather(local.sampled_logprobs),
        sampled_versions=(
            None
            if local.sampled_versions is None
            else torch.tensor(dist.gather_chunked_list(local.sampled_versions.tolist(), n, generate_batch))
        ),
    )


def sample_and_score(
    models: RLModels,
    params: SamplingParams,
    prompts: list[tuple[int, ...]],
    seed: int,
    generate_batch: int,
    step: int = 0,
    records: Sequence[PromptRecord] | None = None,
    from_update: bool = False,
) -> ScoredRollout:
    """Sample and score one batch. Never calls the gold function: RL sees only its reward.

    Prompts are sampled in chunks of `generate_batch`, chunk c seeded from (seed, c) and handled
    by rank c % world_size; every rank then holds the whole batch in global order, so the draw
    and everything after it are the same for any number of processes. Times timing_s/gen, /ref,
    /reward and (unless `from_update`) /old_logprobs and /values.
    """
    pad = models.tokenizer.pad_token_id
    served: dict[int, RolloutBatch] | None = None
    if models.rollout is not None:
        spans = chunk_spans(prompts, seed, generate_batch)
        served = timed("timing_s/gen", lambda: models.rollout.sample_chunks(spans, params, step))
    batches, scored, checks, submitted = [], [], [], []
    reward = models.reward
    frozen = [models.scoring.reference, models.scoring.reward_model]
    frozen += [s.model for s in reward.learned] if reward is not None else []
    with models.runtime.inference(), models.runtime.onloaded(*{id(m): m for m in frozen if m is not None}.values()):
        for c, real in dist.rank_chunks(len(prompts), generate_batch):
            if served is not None:
                batch = served[c]
            elif models.episodes is not None:
                span = records[c * generate_batch : (c + 1) * generate_batch]
                chunk_seed, sample = step_seed(seed, c), models.episodes.sample
                batch = timed("timing_s/gen", lambda: sample(models.actor.model, span, params, chunk_seed, True))
            else:
                chunk = prompts[c * generate_batch : (c + 1) * generate_batch]
                kwargs = models.runtime.generate_kwargs()
                batch = timed(
                    "timing_s/gen",
                    lambda: generate_rollouts(
                        models.actor.model, models.tokenizer, chunk, params, step_seed(seed, c), **kwargs
                    ),
                )
            if reward is not None and real:  # rules and functions score it while the next chunk samples
                span = records[c * generate_batch : c * generate_batch + batch.input_ids.shape[0]]
                submitted.append((reward.submit(batch, span), batch.input_ids.shape[0]))
            parts = _score_chunk(models, params.temperature, batch, step, from_update)
            if real:
                batches.append(batch)
                scored.append(parts)
                if models.rollout is not None and models.rollout.checks_batches:  # old log-probs: the sync probe
                    checks.append(models.rollout.check(batch, parts[0]))
            fault_point("rl", "rollout", step)
        if reward is not None:  # a failed reward source raises here, on every rank alike
            for parts, (handle, rows) in zip(scored, submitted):
                collected = timed("timing_s/reward", lambda: reward.collect(handle, rows))
                parts[3] = torch.cat([parts[3], collected], 1)
            reward.settle()
    if models.rollout is not None and models.rollout.checks_batches:
        add_phases(models.rollout.metrics(checks))
    n = len(prompts)
    batch = _gather_rollout(merge_rollouts(batches, pad), n, generate_batch, pad)

    def gathered(i: int) -> torch.Tensor | None:
        if from_update and i in (0, 2):
            return None
        parts = [s[i] for s in scored]
        return dist.gather_chunked(pad_responses(parts) if i < 3 else torch.cat(parts), n, generate_batch, 0.0, False)

    scores = gathered(3)
    if reward is not None:  # records: the prompts' rows, for a fallback rule reward
        scores = reward.final_scores(scores, records, batch.response_texts)
    return ScoredRollout(batch, gathered(1), scores, gathered(0), gathered(2))


def assemble_experience(
    rollout: ScoredRollout,
    old_logprobs: torch.Tensor,
    values: torch.Tensor,
    kl_coef: float,
    cfg: RLConfig,
    objective: Objective = Objective(),
) -> Experience:
    """Token rewards (the score, with the objective's overlong penalty, on each row's last token,
    minus kl_coef x KL per token unless the KL is a loss term), then advantages and returns by the
    objective's estimator; PPO's GAE advantages are whitened over response tokens if configured.

    old_logprobs, values: [B, R] at sampling time (masked); the rollout's own, or the update's."""
    mask = rollout.batch.response_mask
    o = objective
    kl = token_kl(old_logprobs, rollout.ref_logprobs, o.kl_estimator) * mask
    scores = o.shaped_scores(rollout.scores, rollout.batch)
    rewards = compute_token_rewards(scores, kl, mask, 0.0 if o.kl_in_loss else kl_coef)
    advantages, returns = compute_advantages(
        o.estimator, rewards, values, mask, o.group_size, cfg.gamma, o.lam, o.norm_std
    )
    if o.estimator == "ppo" and o.whiten_advantages and mask.sum() >= 2:  # a variance needs two tokens
        advantages = masked_whiten(advantages, mask)
    is_weights = None
    if o.rollout_correction != "none":
        raw = o.raw_importance_weights(old_logprobs, rollout.batch)
        is_weights = importance_weights(raw, o.rollout_correction, o.correction_cap) * mask
    return Experience(
        rollout.batch,
        old_logprobs,
        rollout.ref_logprobs,
        values,
        scores,
        rewards,
        advantages,
        returns,
        is_weights,
    )


def experience_metrics(
    exp: Experience, kl_coef: float, has_critic: bool = True, objective: Objective = Objective()
) -> dict[str, float]:
    """The rollout's metrics; `kl_coef`: the KL's weight in the reward (or in the loss). Where the
    sampler reported its log-probs, also the gap between it and the trainer (rollout/mismatch_kl,
    is_weight_*, masked_fraction, capped_fraction: engine/algorithms/rollout_correction.py)."""
    mask = exp.batch.response_mask
    if objective.off_policy:  # the samples are an older policy's: weigh each token's k3 back
        kl = behaviour_weighted_kl(exp.old_logprobs, exp.ref_logprobs, exp.batch.sampled_logprobs * mask)
    else:
        kl = token_kl(exp.old_logprobs, exp.ref_logprobs, "k3")
    metrics = {
        "actor/kl": float(masked_mean(kl, mask)),
        "actor/kl_coef": kl_coef,
        "critic/score/mean": float(exp.scores.mean()),
        "critic/score/max": float(exp.scores.max()),
        "critic/score/min": float(exp.scores.min()),
        "critic/rewards/mean": float(masked_mean(exp.token_rewards, mask)),
        "critic/advantages/mean": float(masked_mean(exp.advantages, mask)),
        "critic/returns/mean": float(masked_mean(exp.returns, mask)),
        "response_length/mean": float(mask.sum(1).mean()),
        # Which tokens were drawn, exactly: equal checksums across runs mean identical samples.
        "rollout/response_ids_crc32": float(zlib.crc32((exp.batch.response_ids * mask.long()).numpy().tobytes())),
    }
    if objective.overlong_buffer is not None:
        penalty = objective.shaped_scores(torch.zeros_like(exp.scores), exp.batch)
        metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
        metrics["reward/overlong_penalty/fraction"] = float((penalty < 0).float().mean())
    if exp.batch.sampled_logprobs is not None:
        raw = objective.raw_importance_weights(exp.old_logprobs, exp.batch)
        weights = raw if exp.is_weights is None else exp.is_weights  # none: nothing capped or masked
        gap = correction_metrics(exp.old_logprobs, exp.batch.sampled_logprobs, mask, raw, weights)
        metrics |= {key: float(value) for key, value in gap.items()}
    if has_critic:
        metrics["critic/values/mean"] = float(masked_mean(exp.values, mask))
        metrics["critic/vf_explained_var"] = float(explained_variance(exp.values, exp.returns, mask))
    return metrics
