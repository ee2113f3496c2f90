"""PPO with a per-token critic, a KL-penalised reward and an adaptive KL controller.

One step: sample a batch of responses, score them (reward model, reference, critic), build
per-token rewards and GAE advantages, then several epochs of clipped actor and critic updates
over mini-batches. The maths lives in `algos`; this module only moves tensors between them.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from rlflow.engine import dist
from rlflow.engine.algos import (
    compute_gae_advantages,
    compute_token_rewards,
    explained_variance,
    kl_penalty,
    loss_sum_and_units,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)
from rlflow.engine.backend import LossParts, Runtime, TrainEngine
from rlflow.engine.batching import batch_indices
from rlflow.engine.config import PPOConfig
from rlflow.engine.faults import fault_point
from rlflow.engine.evaluation import PromptSet, ScoringModels, evaluate_policy, normalised_scores
from rlflow.engine.models import token_logprobs, token_values
from rlflow.engine.rollout_service import RolloutService
from rlflow.engine.rollout import (
    RolloutBatch,
    SamplingParams,
    batched_logprobs,
    batched_values,
    generate_rollouts,
    merge_rollouts,
    pad_responses,
)
from rlflow.engine.train_state import step_seed

if TYPE_CHECKING:
    from rlflow.engine.data import PromptRecord
    from rlflow.engine.reward_source import RewardSource


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
    actor: TrainEngine
    critic: TrainEngine
    tokenizer: Any
    scoring: ScoringModels  # reward model, reference, SFT policy, gold (evaluation only)
    runtime: Runtime
    rollout: RolloutService | None = None  # rollout.mode=server: samples come from a worker process
    reward: RewardSource | None = None  # None: the reward model alone (no failure handling, as in evaluation)


def sampling_params(cfg: PPOConfig) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)


@torch.no_grad()
def _score_chunk(models: PPOModels, cfg: PPOConfig, batch: RolloutBatch, step: int) -> list[torch.Tensor]:
    """[old_logprobs, ref_logprobs, values] ([b, R] each) and normalised scores [b] of one chunk."""
    rows = batch.input_ids.shape[0]
    scoring = models.scoring
    return [
        batched_logprobs(models.actor.forward, batch, cfg.temperature, chunk=rows),
        batched_logprobs(scoring.reference, batch, cfg.temperature, chunk=rows),
        batched_values(models.critic.forward, batch, chunk=rows),
        models.reward.model_scores(batch, rows, step)
        if models.reward is not None
        else normalised_scores(scoring.reward_model, batch, scoring.score_norm, rows),
    ]


def _sample_and_score(
    models: PPOModels,
    cfg: PPOConfig,
    prompts: list[tuple[int, ...]],
    c: int,
    real: bool,
    served: dict[int, RolloutBatch] | None,
    generate_batch: int,
    seed: int,
    batches: list,
    scored: list,
    checks: list,
    step: int = 0,
) -> float:
    """Sample (or take the worker's samples of) chunk c and score it; keep it if `real`.
    Returns the seconds spent sampling."""
    started = time.monotonic()
    if served is not None:
        batch = served[c]
    else:
        batch = generate_rollouts(
            models.actor.model,
            models.tokenizer,
            prompts[c * generate_batch : (c + 1) * generate_batch],
            sampling_params(cfg),
            step_seed(seed, c),
            **models.runtime.generate_kwargs(),
        )
    sampled_s = time.monotonic() - started
    parts = _score_chunk(models, cfg, batch, step)
    if real:
        batches.append(batch)
        scored.append(parts)
        if models.rollout is not None:  # PPO's old log-probs double as the weight-sync probe
            checks.append(models.rollout.check(c, parts[0], batch.response_mask))
    return sampled_s


def make_experience(
    models: PPOModels,
    cfg: PPOConfig,
    prompts: list[tuple[int, ...]],
    kl_coef: float,
    seed: int,
    timings: dict[str, float],
    generate_batch: int,
    step: int = 0,
    records: Sequence[PromptRecord] | None = None,
) -> Experience:
    """Sample and score one batch. Never calls the gold function: PPO sees only the reward model.

    Prompts are sampled in chunks of `generate_batch`, chunk c seeded from (seed, c) and handled
    by rank c % world_size; every rank then holds the whole batch in global order, so the draw
    and everything after it are the same for any number of processes.
    """
    t0 = time.monotonic()
    pad, params = models.tokenizer.pad_token_id, sampling_params(cfg)
    served: dict[int, RolloutBatch] | None = None
    if models.rollout is not None:
        n_chunks = -(-len(prompts) // generate_batch)
        spans = [
            (c, prompts[c * generate_batch : (c + 1) * generate_batch], step_seed(seed, c)) for c in range(n_chunks)
        ]
        served = models.rollout.sample_chunks(spans, params)
    batches, scored, checks, gen_s = [], [], [], time.monotonic() - t0
    frozen = (models.scoring.reference, models.scoring.reward_model)
    with models.runtime.inference(), models.runtime.onloaded(*frozen):
        for c, real in dist.rank_chunks(len(prompts), generate_batch):
            gen_s += _sample_and_score(
                models, cfg, prompts, c, real, served, generate_batch, seed, batches, scored, checks, step
            )
            fault_point("ppo", "rollout", step)
        if models.reward is not None:  # a failed reward source raises here, on every rank alike
            models.reward.settle()
    if models.rollout is not None:
        timings.update(models.rollout.metrics(checks))
    local = merge_rollouts(batches, pad)
    n, gather = len(prompts), lambda t, value=0.0, left=False: dist.gather_chunked(t, n, generate_batch, value, left)
    width = local.prompt_width
    batch = RolloutBatch(
        input_ids=torch.cat([gather(local.input_ids[:, :width], pad, True), gather(local.response_ids, pad)], 1),
        attention_mask=torch.cat(
            [gather(local.attention_mask[:, :width], 0, True), gather(local.attention_mask[:, width:])], 1
        ),
        response_mask=gather(local.response_mask),
        prompt_width=0,  # set below from the gathered prompt width
        response_texts=tuple(dist.gather_chunked_list(local.response_texts, n, generate_batch)),
    )
    prompt_width = batch.input_ids.shape[1] - batch.response_mask.shape[1]
    batch = RolloutBatch(batch.input_ids, batch.attention_mask, batch.response_mask, prompt_width, batch.response_texts)
    old_logprobs, ref_logprobs, values = (gather(pad_responses([s[i] for s in scored])) for i in range(3))
    scores = gather(torch.cat([s[3] for s in scored]))
    if models.reward is not None:  # records: the prompts' rows, for a fallback rule reward
        scores = models.reward.final_scores(scores, records, batch.response_texts)
    mask = batch.response_mask
    kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl.estimator) * mask
    rewards = compute_token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = compute_gae_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages and mask.sum() >= 2:  # a variance needs two tokens
        advantages = masked_whiten(advantages, mask)
    timings.update({"timing_s/gen": gen_s, "timing_s/score": time.monotonic() - t0 - gen_s})
    return Experience(batch, old_logprobs, ref_logprobs, values, scores, rewards, advantages, returns)


def actor_loss(model: torch.nn.Module, exp: Experience, index: torch.Tensor, cfg: PPOConfig) -> LossParts:
    """Clipped policy loss of the rows `index` [M] as a share of `cfg.loss_agg` over the mini-batch."""
    batch, mask = exp.batch.rows(index), exp.batch.response_mask[index]
    logprobs, entropy = token_logprobs(
        model, batch.input_ids, batch.attention_mask, batch.prompt_width, cfg.temperature, with_entropy=True
    )
    device = logprobs.device  # experience stays on the CPU; each micro-batch's slice comes over
    mask = mask.to(device)
    pg, clipped, approx_kl = ppo_policy_loss(
        logprobs, exp.old_logprobs[index].to(device), exp.advantages[index].to(device), cfg.clip_ratio
    )
    loss_sum, units = loss_sum_and_units(pg, mask, cfg.loss_agg)
    tokens = float(mask.sum())
    return LossParts(
        loss_sum,
        units,
        {
            "actor/pg_clipfrac": (float(masked_sum(clipped, mask)), tokens),
            "actor/ppo_kl": (float(masked_sum(approx_kl.detach(), mask)), tokens),
            "actor/entropy": (float(masked_sum(entropy.detach(), mask)), tokens),
        },
    )


def critic_loss(model: torch.nn.Module, exp: Experience, index: torch.Tensor, cfg: PPOConfig) -> LossParts:
    """Clipped value loss of the rows `index` [M]; values are read at the token before each response token."""
    batch, mask = exp.batch.rows(index), exp.batch.response_mask[index]
    values = token_values(model, batch.input_ids, batch.attention_mask)[:, batch.prompt_width - 1 : -1]
    mask = mask.to(values.device)
    vf, vf_clipped = value_loss(
        values, exp.values[index].to(mask.device), exp.returns[index].to(mask.device), cfg.value_clip
    )
    loss_sum, units = loss_sum_and_units(vf, mask, cfg.loss_agg)
    return LossParts(loss_sum, units, {"critic/vf_clipfrac": (float(masked_sum(vf_clipped, mask)), float(mask.sum()))})


def loss_units(mask: torch.Tensor, mode: str) -> float:
    """Units a micro-batch's loss is normalised over (must match loss_sum_and_units)."""
    return float(mask.bool().sum()) if mode == "token-mean" else float(mask.shape[0])


def ppo_update(
    models: PPOModels,
    exp: Experience,
    cfg: PPOConfig,
    update_actor: bool,
    seed: int,
    timings: dict[str, float],
    step: int = 0,
) -> dict[str, float]:
    """`cfg.epochs` passes of clipped actor and critic updates over shuffled mini-batches.

    Mini-batches are drawn from the whole batch (the same on every rank); each rank trains on its
    share, cut into micro-batches. During critic warm-up (`update_actor` False) the actor is not
    run. Returns metrics averaged over mini-batches, and "skipped": 1.0 if any update was skipped
    for a non-finite loss or gradient norm; adds timing_s/update_actor and _critic.
    """
    skipped = 0.0
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    generator = torch.Generator().manual_seed(seed)
    models.actor.train(), models.critic.train()
    parts = [("actor", models.actor, actor_loss)] if update_actor else []
    parts.append(("critic", models.critic, critic_loss))
    # Rows keep the batch's padded width in every micro-batch: that is what the budget must count.
    lengths = [exp.batch.input_ids.shape[1]] * exp.batch.input_ids.shape[0]
    for _ in range(cfg.epochs):
        for index in torch.randperm(exp.batch.input_ids.shape[0], generator=generator).split(cfg.mini_batch):
            mine = index[dist.rank() :: dist.world_size()]
            micro = [mine[g] for g in models.runtime.micro_batches([lengths[i] for i in mine.tolist()])]
            units = [loss_units(exp.batch.response_mask[m], cfg.loss_agg) for m in micro]
            for name, engine, loss_fn in parts:
                started = time.monotonic()
                out = engine.train_step(micro, units, lambda model, m, f=loss_fn: f(model, exp, m, cfg))
                fault_point("ppo", "update", step)
                skipped = max(skipped, out["skipped"])
                metrics = {k: v for k, v in out.items() if k.startswith(f"{name}/")}
                metrics[f"{name}/{'pg_loss' if name == 'actor' else 'vf_loss'}"] = out["loss"]
                metrics[f"{name}/grad_norm"] = out["grad_norm"]
                timings[f"timing_s/update_{name}"] = (
                    timings.get(f"timing_s/update_{name}", 0.0) + time.monotonic() - started
                )
                for key, value in metrics.items():
                    sums[key], counts[key] = sums.get(key, 0.0) + value, counts.get(key, 0) + 1
    return {k: v / counts[k] for k, v in sums.items()} | {"skipped": skipped}


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
        # Which tokens were drawn, exactly: equal checksums across runs mean identical samples.
        "rollout/response_ids_crc32": float(zlib.crc32((exp.batch.response_ids * mask.long()).numpy().tobytes())),
    }


def ppo_step(
    models: PPOModels,
    kl_controller,
    cfg: PPOConfig,
    prompts: PromptSet,
    seed: int,
    round_index: int,
    step: int,
    generate_batch: int,
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
        generate_batch,
        step,
        [prompts.records[i] for i in index],
    )
    metrics = experience_metrics(exp, kl_controller.value)
    metrics.update(
        ppo_update(
            models, exp, cfg, step > cfg.critic_warmup_steps, step_seed(seed, round_index, step, 5), timings, step
        )
    )
    if models.rollout is not None:  # the worker samples the next step with the updated actor
        timings.update(models.rollout.sync(models.actor))
    kl_controller.update(metrics["actor/kl"], cfg.rollout_batch)
    timings["timing_s/step"] = time.monotonic() - started
    timings["timing_s/other"] = timings["timing_s/step"] - sum(v for k, v in timings.items() if k != "timing_s/step")
    metrics.update(timings)
    metrics["perf/throughput"] = float(exp.batch.attention_mask.sum()) / timings["timing_s/step"]
    return metrics


def make_controller(cfg: PPOConfig):
    return make_kl_controller(cfg.kl.controller, cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)


def run_evaluation(models: PPOModels, prompts: PromptSet, cfg: PPOConfig, seed: int, batch_size: int, n_samples: int):
    return evaluate_policy(
        models.actor.model,
        models.tokenizer,
        prompts,
        models.scoring,
        sampling_params(cfg),
        seed,
        batch_size,
        n_samples,
        models.runtime.generate_kwargs(),
    )
