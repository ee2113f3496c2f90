"""One RL step, the same for every estimator (PPO, GRPO, RLOO, REINFORCE++).

One step: sample a batch of responses, score them (reward sources, reference, critic), build
per-token rewards and advantages by the objective's estimator (engine/stages/rl/experience.py), then
epochs of clipped actor (and, for PPO, critic) updates over mini-batches. The maths lives in
engine/algorithms; this module only moves tensors between them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from rlflow.engine.backend import dist
from rlflow.engine.algorithms.kl import token_kl
from rlflow.engine.algorithms.losses import loss_sum_and_units, loss_units, value_loss
from rlflow.engine.algorithms.policy_losses import policy_loss
from rlflow.engine.algorithms.kl import make_kl_controller
from rlflow.engine.algorithms.stats import masked_sum
from rlflow.engine.backend.runtime import LossParts, TrainEngine
from rlflow.engine.data.batching import batch_indices
from rlflow.engine.config.kl import KLConfig
from rlflow.engine.config.stages import RLConfig
from rlflow.engine.data.prompts import PromptSet
from rlflow.engine.stages.rl.dynamic_sampling import sample_informative
from rlflow.engine.stages.rl.experience import (
    Experience,
    Objective,
    RLModels,
    ScoredRollout,
    assemble_experience,
    experience_metrics,
    sample_and_score,
)
from rlflow.engine.models.loading import token_logprobs, token_values
from rlflow.engine.faults import fault_point
from rlflow.engine.rollout.episodes import episode_metrics
from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.rollout.lookahead import StepPlan, chunk_spans, staleness_metrics
from rlflow.engine.seeds import step_seed
from rlflow.engine.telemetry.phases import add_phases, phase, timed

if TYPE_CHECKING:
    from collections.abc import Callable

    from rlflow.engine.data.records import PromptRecord


def actor_forward(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of the response tokens at the sampling temperature, [M, R] each, with
    grad, on the model's device."""
    return token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width, temperature, with_entropy=True)


def actor_loss_parts(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    exp: Experience,
    index: torch.Tensor,
    cfg: RLConfig,
    objective: Objective = Objective(),
) -> LossParts:
    """The objective's policy loss of the rows `index` [M] (times the rollout-correction weights,
    if any; plus kl_loss_coef x the KL to the reference per token when the objective puts the KL
    in the loss) as a share of `cfg.loss_agg` over the mini-batch; logprobs, entropy: [M, R] from
    actor_forward on those rows."""
    device = logprobs.device  # experience stays on the CPU; each micro-batch's slice comes over
    mask = exp.batch.response_mask[index].to(device)
    old, advantages = exp.old_logprobs[index].to(device), exp.advantages[index].to(device)
    loss_fn = policy_loss(objective.policy_loss)
    per_token, clipped, approx_kl = loss_fn(logprobs, old, advantages, mask, *cfg.clip_bounds)
    if exp.is_weights is not None:
        per_token = per_token * exp.is_weights[index].to(device)
    tokens = float(mask.sum())
    stats = {
        "actor/pg_clipfrac": (float(masked_sum(clipped, mask)), tokens),
        "actor/ppo_kl": (float(masked_sum(approx_kl.detach(), mask)), tokens),
        "actor/entropy": (float(masked_sum(entropy.detach(), mask)), tokens),
    }
    if objective.kl_in_loss:
        kl = token_kl(logprobs, exp.ref_logprobs[index].to(device), objective.kl_estimator)
        per_token = per_token + objective.kl_loss_coef * kl
        stats["actor/kl_loss"] = (float(masked_sum(kl.detach(), mask)), tokens)
    loss_sum, units = loss_sum_and_units(per_token, mask, cfg.loss_agg, norm_length(cfg, objective))
    return LossParts(loss_sum, units, stats)


def actor_loss(
    model: torch.nn.Module, exp: Experience, index: torch.Tensor, cfg: RLConfig, objective: Objective = Objective()
) -> LossParts:
    rows = exp.batch.rows(index)
    return actor_loss_parts(*actor_forward(model, rows, objective.sampling.temperature), exp, index, cfg, objective)


def critic_forward(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """Values [M, R] of the response tokens, read at the token before each one, with grad."""
    return token_values(model, batch.input_ids, batch.attention_mask)[:, batch.prompt_width - 1 : -1]


def critic_loss_parts(
    values: torch.Tensor, exp: Experience, index: torch.Tensor, cfg: RLConfig, objective: Objective = Objective()
) -> LossParts:
    """Clipped value loss of the rows `index` [M]; values [M, R] from critic_forward on those rows."""
    mask = exp.batch.response_mask[index].to(values.device)
    vf, vf_clipped = value_loss(
        values, exp.values[index].to(mask.device), exp.returns[index].to(mask.device), objective.value_clip
    )
    loss_sum, units = loss_sum_and_units(vf, mask, cfg.loss_agg, norm_length(cfg, objective))
    return LossParts(loss_sum, units, {"critic/vf_clipfrac": (float(masked_sum(vf_clipped, mask)), float(mask.sum()))})


def critic_loss(
    model: torch.nn.Module, exp: Experience, index: torch.Tensor, cfg: RLConfig, objective: Objective = Objective()
) -> LossParts:
    return critic_loss_parts(critic_forward(model, exp.batch.rows(index)), exp, index, cfg, objective)


def norm_length(cfg: RLConfig, objective: Objective) -> int | None:
    """seq-mean-token-sum-norm's constant: the generation budget, sampling.max_new_tokens (Dr. GRPO)."""
    return objective.sampling.max_new_tokens if cfg.loss_agg == "seq-mean-token-sum-norm" else None


class UpdateMetrics:
    """Per-update metrics averaged over mini-batches, plus "skipped" and the update timings."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.skipped = 0.0

    def run(self, name: str, engine: TrainEngine, micro: list, units: list, loss_fn: Callable, step: int) -> None:
        """One optimizer step of `engine`, timed as timing_s/update_<name>."""
        with phase(f"timing_s/update_{name}"):
            out = engine.train_step(micro, units, loss_fn)
        self.skipped = max(self.skipped, out["skipped"])
        metrics = {k: v for k, v in out.items() if k.startswith(f"{name}/")}
        metrics[f"{name}/{'pg_loss' if name == 'actor' else 'vf_loss'}"] = out["loss"]
        metrics[f"{name}/grad_norm"] = out["grad_norm"]
        for key, value in metrics.items():
            self.sums[key], self.counts[key] = self.sums.get(key, 0.0) + value, self.counts.get(key, 0) + 1

    def result(self) -> dict[str, float]:
        return {k: v / self.counts[k] for k, v in self.sums.items()} | {"skipped": self.skipped}


def rl_update(
    models: RLModels,
    exp: Experience,
    cfg: RLConfig,
    update_actor: bool,
    seed: int,
    step: int = 0,
    objective: Objective = Objective(),
) -> dict[str, float]:
    """`cfg.epochs` passes of clipped actor and (if there is one) critic updates over shuffled
    mini-batches of `cfg.mini_batch` prompts (x rollout.n samples each).

    Mini-batches are drawn from the whole batch (the same on every rank); each rank trains on its
    share, cut into micro-batches. During critic warm-up (`update_actor` False) the actor is not
    run. Returns metrics averaged over mini-batches, and "skipped": 1.0 if any update was skipped
    for a non-finite loss or gradient norm; adds timing_s/update_actor and _critic.
    """
    record = UpdateMetrics()
    generator = torch.Generator().manual_seed(seed)
    models.actor.train()
    parts = []
    if update_actor:
        parts.append(("actor", models.actor, lambda model, e, m, c: actor_loss(model, e, m, c, objective)))
    if models.critic is not None:
        models.critic.train()
        parts.append(("critic", models.critic, lambda model, e, m, c: critic_loss(model, e, m, c, objective)))
    # Rows keep the batch's padded width in every micro-batch: that is what the budget must count.
    lengths = [exp.batch.input_ids.shape[1]] * exp.batch.input_ids.shape[0]
    for _ in range(cfg.epochs):
        rows = torch.randperm(exp.batch.input_ids.shape[0], generator=generator)
        for index in rows.split(cfg.mini_batch * objective.group_size):
            mine = index[dist.rank() :: dist.world_size()]
            micro = [mine[g] for g in models.runtime.micro_batches([lengths[i] for i in mine.tolist()])]
            units = [loss_units(exp.batch.response_mask[m], cfg.loss_agg) for m in micro]
            for name, engine, loss_fn in parts:
                record.run(name, engine, micro, units, lambda model, m, f=loss_fn: f(model, exp, m, cfg), step)
    return record.result()


def single_pass_possible(models: RLModels, cfg: RLConfig, update_actor: bool, group_size: int = 1) -> bool:
    """Whether the update is one optimizer step per model over the whole batch in one forward:
    one epoch, one mini-batch, one micro-batch (no token budget to cut it), one process, samples
    drawn here or off-policy. Its forwards then run on exactly the weights of the proximal policy
    (the sampler's, or off-policy the trainer's before the update: the behaviour policy's gap is
    the rollout correction's), so they are the old log-probs and values (PPO's ratio is exactly 1
    there) and the two scoring passes are skipped, not approximated. A synchronous rollout replica
    needs the old log-probs first: they are its weight-sync probe."""
    rows, runtime = cfg.rollout_batch * group_size, models.runtime
    if not (update_actor and cfg.epochs == 1 and cfg.mini_batch == cfg.rollout_batch and dist.world_size() == 1):
        return False
    if models.rollout is not None and models.rollout.checks_batches:
        return False
    if runtime.name != "torch" or runtime.cfg.max_tokens_per_microbatch is not None:
        return False
    return len(runtime.micro_batches([1] * rows)) == 1


def single_pass_update(
    models: RLModels,
    rollout: ScoredRollout,
    cfg: RLConfig,
    kl_coef: float,
    step: int,
    objective: Objective = Objective(),
) -> tuple[Experience, dict[str, float]]:
    """The update of a `single_pass_possible` step: actor and critic forwards with grad, their
    detached outputs taken as sampling-time log-probs and values, the experience assembled from
    them, then each loss backward and one optimizer step. Both graphs are alive at once: the
    price of skipping two passes is actor plus critic activations at the peak."""
    batch, rows = rollout.batch, torch.arange(rollout.batch.input_ids.shape[0])
    models.actor.train()
    mask, critic = batch.response_mask, models.critic
    temperature = objective.sampling.temperature
    logprobs, entropy = timed("timing_s/update_actor", lambda: actor_forward(models.actor.forward, batch, temperature))
    if critic is not None:
        critic.train()
        values = timed("timing_s/update_critic", lambda: critic_forward(critic.forward, batch))
        sampled_values = values.detach().cpu() * mask
    else:
        sampled_values = rollout.values
    exp = assemble_experience(rollout, logprobs.detach().cpu() * mask, sampled_values, kl_coef, cfg, objective)
    units = [loss_units(mask, cfg.loss_agg)]
    record = UpdateMetrics()
    actor_parts = lambda _, m: actor_loss_parts(logprobs, entropy, exp, m, cfg, objective)  # noqa: E731
    record.run("actor", models.actor, [rows], units, actor_parts, step)
    if critic is not None:
        critic_parts = lambda _, m: critic_loss_parts(values, exp, m, cfg, objective)  # noqa: E731
        record.run("critic", critic, [rows], units, critic_parts, step)
    return exp, record.result()


def sample_step(
    models: RLModels, cfg: RLConfig, prompts: PromptSet, seed: int, round_index: int, step: int, generate_batch: int,
    objective: Objective, from_update: bool,
) -> tuple[ScoredRollout, dict[str, float]]:
    """What RL step `step` trains on: `cfg.rollout_batch` prompts x `objective.group_size` samples each
    (consecutive rows; DAPO's dynamic sampling tries again for informative groups), scored, and the
    rollout's own metrics (staleness, the weight sync's probe). `from_update`: the update computes
    the old log-probs and values (single_pass_possible)."""

    def sample(attempt: int) -> ScoredRollout:
        if models.rollout is not None and models.rollout.cfg.async_:  # the groups the stream holds
            index_of = stream_prompts(len(prompts.token_ids), cfg, seed, round_index)
            draw = stream_draw(prompts, index_of, models.rollout.take_groups(step), objective.group_size)
        else:
            draw = step_draw(prompts, cfg.rollout_batch, objective.group_size, step, seed, round_index, attempt)
        return sample_and_score(
            models, objective.sampling, draw.rows, draw.seed, generate_batch, step, draw.records, from_update
        )

    sampled_metrics: dict[str, float] = {}
    if objective.dynamic_sampling_max_tries is None:
        rollout = sample(0)
    else:
        pad, tries = models.tokenizer.pad_token_id, objective.dynamic_sampling_max_tries
        rollout, sampled_metrics = sample_informative(sample, objective, cfg.rollout_batch, tries, pad)
    if rollout.batch.sampled_versions is not None:  # asserts the bound on every row trained on
        bound = models.rollout.cfg.staleness_bound
        sampled_metrics |= staleness_metrics(rollout.batch.sampled_versions, step - 1, bound)
    if models.rollout is not None:  # off-policy: the last weight sync's probe, before the weights move
        sampled_metrics |= models.rollout.verify_sync(models.actor)
    fault_point("rl", "batch_received", step)
    return rollout, sampled_metrics


def after_update(
    models: RLModels, kl_controller: Any, exp: Experience, kl_coef: float, objective: Objective, step: int
) -> dict[str, float]:
    """After the updates: the experience's metrics and the reward sources' and episodes'; the rollout
    replicas get the updated weights; the KL controller moves (unless the KL is a loss term)."""
    kl_weight = objective.kl_loss_coef if objective.kl_in_loss else kl_coef
    metrics = experience_metrics(exp, kl_weight, models.critic is not None, objective)
    if models.reward is not None:
        metrics |= models.reward.metrics
    if models.episodes is not None:
        metrics |= episode_metrics([t.summary() for t in models.episodes.take()], "env/")
    if models.rollout is not None:  # the replica samples the next step(s) with the updated actor
        add_phases(models.rollout.sync(models.actor, step, step))
        add_phases(models.rollout.idle_metrics())
    if not objective.kl_in_loss:  # with the KL in the loss its coefficient is fixed
        kl_controller.update(metrics["actor/kl"], exp.batch.input_ids.shape[0])
    return metrics


def with_timings(
    metrics: dict[str, float], timings: dict[str, float], seconds: float, exp: Experience
) -> dict[str, float]:
    """The step's metrics with its timing_s/* phases, timing_s/step (`seconds`) and timing_s/other: what
    no phase timed (the rollout replica's figures in the collection are not seconds, and the waits
    overlap the phases: the trainer's inside gen, the replica's in another process; a timing_s/<phase>/<part>
    is part of its phase, e.g. timing_s/update_weights/replica_load)."""
    timings = dict(timings, **{"timing_s/step": seconds})
    phases = [v for k, v in timings.items() if k.startswith("timing_s/") and k.count("/") == 1 and k not in NOT_PHASES]
    timings["timing_s/other"] = seconds - sum(phases)
    return metrics | timings | {"perf/throughput": float(exp.batch.attention_mask.sum()) / seconds}


NOT_PHASES = ("timing_s/step", "timing_s/wait_rollout", "timing_s/wait_train")


@dataclass(frozen=True)
class StepDraw:
    """The prompts one step samples: consecutive group_size copies of each drawn prompt."""

    rows: list[tuple[int, ...]]  # token ids, B = rollout_batch x group_size
    records: list[PromptRecord]  # the rows' prompt records (for rule and function rewards)
    seed: int  # the sampling seed; chunk c of generate_batch rows is seeded (seed, c)


def step_draw(
    prompts: PromptSet, rollout_batch: int, group_size: int, step: int, seed: int, round_index: int, attempt: int = 0
) -> StepDraw:
    """What step `step` samples: a pure function of its arguments (the off-policy sampler plans
    steps ahead with it). Try 0 draws the step's prompts and seed; a further try of dynamic
    sampling (`attempt` > 0) its own."""
    extra = (attempt,) if attempt else ()
    index = batch_indices(len(prompts.token_ids), rollout_batch, step, seed, round_index, 3, *extra)
    index = [i for i in index for _ in range(group_size)]
    rows = [prompts.token_ids[i] for i in index]
    return StepDraw(rows, [prompts.records[i] for i in index], step_seed(seed, round_index, step, 4, *extra))


def stream_prompts(n_prompts: int, cfg: RLConfig, seed: int, round_index: int) -> Callable[[int], int]:
    """rollout.async's group stream: group g -> the index of its prompt, the prompt a synchronous
    run draws at position g % B of step g // B + 1 (B = rl.rollout_batch)."""

    @functools.lru_cache(maxsize=8)
    def drawn(step: int) -> list[int]:
        return batch_indices(n_prompts, cfg.rollout_batch, step, seed, round_index, 3)

    return lambda group: drawn(group // cfg.rollout_batch + 1)[group % cfg.rollout_batch]


def stream_draw(prompts: PromptSet, prompt_index: Callable[[int], int], groups: list[int], group_size: int) -> StepDraw:
    """The draw of the stream's `groups` (the seed is unused: their samples come from the replica)."""
    index = [prompt_index(g) for g in groups for _ in range(group_size)]
    return StepDraw([prompts.token_ids[i] for i in index], [prompts.records[i] for i in index], 0)


def rollout_plan(
    prompts: PromptSet, cfg: RLConfig, objective: Objective, seed: int, round_index: int, generate_batch: int
) -> Callable[[int], StepPlan]:
    """step -> what the rollout replica samples for it: the step's draw, cut into generate requests."""

    def plan(step: int) -> StepPlan:
        draw = step_draw(prompts, cfg.rollout_batch, objective.group_size, step, seed, round_index)
        return StepPlan(chunk_spans(draw.rows, draw.seed, generate_batch), objective.sampling)

    return plan


def make_controller(kl: KLConfig):
    return make_kl_controller(kl.controller, kl.coef, kl.target, kl.horizon)
