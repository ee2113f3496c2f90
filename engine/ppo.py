"""PPO with a per-token critic, a KL-penalised reward and an adaptive KL controller.

One step: sample a batch of responses, score them (reward model, reference, critic), build
per-token rewards and GAE advantages, then several epochs of clipped actor and critic updates
over mini-batches. The maths lives in `algos`; this module only moves tensors between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.algos import (
    aggregate_loss,
    compute_gae_advantages,
    compute_token_rewards,
    explained_variance,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)
from rlflow.engine.batching import batch_indices
from rlflow.engine.config import PPOConfig
from rlflow.engine.evaluation import PromptSet, ScoringModels, evaluate_policy, normalised_scores
from rlflow.engine.models import token_logprobs, token_values
from rlflow.engine.rollout import RolloutBatch, SamplingParams, batched_logprobs, batched_values, generate_rollouts
from rlflow.engine.train_state import make_optimizer, step_seed


@dataclass(frozen=True)
class Experience:
    """A scored rollout, ready for updates. B rows, R response tokens."""

    batch: RolloutBatch
    old_logprobs: torch.Tensor  # [B, R] policy log-probs at sampling time
    ref_logprobs: torch.Tensor  # [B, R] reference log-probs
    values: torch.Tensor  # [B, R] critic values at sampling time
    scores: torch.Tensor  # [B] normalised reward-model scores
    token_rewards: torch.Tensor  # [B, R] -kl_coef * KL per token, + score at the last token
    advantages: torch.Tensor  # [B, R] GAE, whitened over response tokens if configured
    returns: torch.Tensor  # [B, R] GAE returns (critic targets)


@dataclass
class PPOModels:
    actor: torch.nn.Module
    critic: torch.nn.Module
    tokenizer: Any
    scoring: ScoringModels  # reward model, reference, SFT policy, gold (evaluation only)


def sampling_params(cfg: PPOConfig) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)


def make_experience(
    models: PPOModels,
    cfg: PPOConfig,
    prompts: list[tuple[int, ...]],
    kl_coef: float,
    seed: int,
    timings: dict[str, float],
) -> Experience:
    """Sample and score one batch. Never calls the gold function: PPO sees only the reward model."""
    t0 = time.monotonic()
    batch = generate_rollouts(models.actor, models.tokenizer, prompts, sampling_params(cfg), seed)
    t1 = time.monotonic()
    old_logprobs = batched_logprobs(models.actor, batch, cfg.temperature)
    ref_logprobs = batched_logprobs(models.scoring.reference, batch, cfg.temperature)
    t2 = time.monotonic()
    values = batched_values(models.critic, batch)
    t3 = time.monotonic()
    scores = normalised_scores(models.scoring.reward_model, batch, models.scoring.score_norm)
    mask = batch.response_mask
    kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl.estimator) * mask
    rewards = compute_token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = compute_gae_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages and mask.sum() >= 2:  # a variance needs two tokens
        advantages = masked_whiten(advantages, mask)
    timings.update(
        {
            "timing_s/gen": t1 - t0,
            "timing_s/ref": t2 - t1,
            "timing_s/values": t3 - t2,
            "timing_s/score": time.monotonic() - t3,
        }
    )
    return Experience(batch, old_logprobs, ref_logprobs, values, scores, rewards, advantages, returns)


def actor_loss(
    models: PPOModels, exp: Experience, index: torch.Tensor, cfg: PPOConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss of the rows `index` [M], aggregated per `cfg.loss_agg`."""
    batch, mask = exp.batch.rows(index), exp.batch.response_mask[index]
    logprobs, entropy = token_logprobs(
        models.actor, batch.input_ids, batch.attention_mask, batch.prompt_width, cfg.temperature, with_entropy=True
    )
    pg, clipped, approx_kl = ppo_policy_loss(logprobs, exp.old_logprobs[index], exp.advantages[index], cfg.clip_ratio)
    loss = aggregate_loss(pg, mask, cfg.loss_agg)
    return loss, {
        "actor/pg_loss": float(loss.detach()),
        "actor/pg_clipfrac": float(masked_mean(clipped, mask)),
        "actor/ppo_kl": float(masked_mean(approx_kl, mask)),
        "actor/entropy": float(masked_mean(entropy.detach(), mask)),
    }


def critic_loss(
    models: PPOModels, exp: Experience, index: torch.Tensor, cfg: PPOConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of the rows `index` [M]; values are read at the token before each response token."""
    batch, mask = exp.batch.rows(index), exp.batch.response_mask[index]
    values = token_values(models.critic, batch.input_ids, batch.attention_mask)[:, batch.prompt_width - 1 : -1]
    vf, vf_clipped = value_loss(values, exp.values[index], exp.returns[index], cfg.value_clip)
    loss = aggregate_loss(vf, mask, cfg.loss_agg)
    return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": float(masked_mean(vf_clipped, mask))}


def _apply_gradients(
    loss: torch.Tensor, network: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(network.parameters(), max_norm)
    optimizer.step()
    return float(grad_norm)


def ppo_update(
    models: PPOModels,
    optimizers: dict[str, torch.optim.Optimizer],
    exp: Experience,
    cfg: PPOConfig,
    update_actor: bool,
    seed: int,
    timings: dict[str, float],
) -> dict[str, float]:
    """`cfg.epochs` passes of clipped actor and critic updates over shuffled mini-batches.

    During critic warm-up (`update_actor` False) the actor is not even run. Returns the
    metrics averaged over mini-batches; adds timing_s/update_actor and timing_s/update_critic.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    generator = torch.Generator().manual_seed(seed)
    models.actor.train(), models.critic.train()
    parts = [("actor", models.actor, actor_loss)] if update_actor else []
    parts.append(("critic", models.critic, critic_loss))
    for _ in range(cfg.epochs):
        for index in torch.randperm(exp.batch.input_ids.shape[0], generator=generator).split(cfg.mini_batch):
            for name, network, loss_fn in parts:
                started = time.monotonic()
                loss, metrics = loss_fn(models, exp, index, cfg)
                metrics[f"{name}/grad_norm"] = _apply_gradients(loss, network, optimizers[name], cfg.max_grad_norm)
                timings[f"timing_s/update_{name}"] = (
                    timings.get(f"timing_s/update_{name}", 0.0) + time.monotonic() - started
                )
                for key, value in metrics.items():
                    sums[key], counts[key] = sums.get(key, 0.0) + value, counts.get(key, 0) + 1
    return {k: v / counts[k] for k, v in sums.items()}


def experience_metrics(exp: Experience, kl_coef: float) -> dict[str, float]:
    mask = exp.batch.response_mask
    return {
        "actor/kl": float(masked_mean(kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k3"), mask)),
        "actor/kl_coef": kl_coef,
        "critic/score/mean": float(exp.scores.mean()),
        "critic/score/max": float(exp.scores.max()),
        "critic/score/min": float(exp.scores.min()),
        "critic/rewards/mean": float(masked_mean(exp.token_rewards, mask)),
        "critic/advantages/mean": float(masked_mean(exp.advantages, mask)),
        "critic/returns/mean": float(masked_mean(exp.returns, mask)),
        "critic/values/mean": float(masked_mean(exp.values, mask)),
        "critic/vf_explained_var": float(explained_variance(exp.values, exp.returns, mask)),
        "response_length/mean": float(mask.sum(1).mean()),
    }


def ppo_step(
    models: PPOModels,
    optimizers,
    kl_controller,
    cfg: PPOConfig,
    prompts: PromptSet,
    seed: int,
    round_index: int,
    step: int,
) -> dict[str, float]:
    """One PPO step (1-based `step`): rollout, scoring, updates, KL controller. Returns metrics."""
    started = time.monotonic()
    timings: dict[str, float] = {}
    index = batch_indices(len(prompts.token_ids), cfg.rollout_batch, step, seed, round_index, 3)
    exp = make_experience(
        models,
        cfg,
        [prompts.token_ids[i] for i in index],
        kl_controller.value,
        step_seed(seed, round_index, step, 4),
        timings,
    )
    metrics = experience_metrics(exp, kl_controller.value)
    metrics.update(
        ppo_update(
            models, optimizers, exp, cfg, step > cfg.critic_warmup_steps, step_seed(seed, round_index, step, 5), timings
        )
    )
    kl_controller.update(metrics["actor/kl"], cfg.rollout_batch)
    timings["timing_s/step"] = time.monotonic() - started
    timings["timing_s/other"] = timings["timing_s/step"] - sum(v for k, v in timings.items() if k != "timing_s/step")
    metrics.update(timings)
    metrics["perf/throughput"] = float(exp.batch.attention_mask.sum()) / timings["timing_s/step"]
    return metrics


def make_ppo_optimizers(models: PPOModels, cfg: PPOConfig) -> dict[str, torch.optim.Optimizer]:
    return {
        "actor": make_optimizer(models.actor, cfg.actor_lr, 0.0),
        "critic": make_optimizer(models.critic, cfg.critic_lr, 0.0),
    }


def make_controller(cfg: PPOConfig):
    return make_kl_controller(cfg.kl.controller, cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)


def run_evaluation(models: PPOModels, prompts: PromptSet, cfg: PPOConfig, seed: int, batch_size: int, n_samples: int):
    return evaluate_policy(
        models.actor, models.tokenizer, prompts, models.scoring, sampling_params(cfg), seed, batch_size, n_samples
    )
