"""The PPO stage: load the four models, run PPO steps with checkpoints, evaluations, KL stop and
the guards (KL circuit breaker, reward-source failures: engine/breaker.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlflow.engine.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
)
from rlflow.engine.data import load_prompts
from rlflow.engine.evaluation import PromptSet, ScoringModels, encode_prompt_set
from rlflow.engine import dist
from rlflow.engine.backend import OptimSpec, Runtime
from rlflow.engine.breaker import Breach, PPOGuards, PPOSafety, paused_outcome
from rlflow.engine.errors import RewardSourceError
from rlflow.engine.rollout_service import RolloutService
from rlflow.engine.models import disable_dropout, load_policy, load_scalar_model, load_tokenizer, model_kwargs
from rlflow.engine.experience import Objective, PPOModels
from rlflow.engine.lora import AdaptersOffView, lora_metrics
from rlflow.engine.reward_source import build_reward_source, start_reward_pool
from rlflow.engine.ppo import make_controller, ppo_step, run_evaluation
from rlflow.engine.stage_guard import StageGuard
from rlflow.engine.stage import (
    StageContext,
    StageOutcome,
    completed_outcome,
    finish,
    restore_training_state,
    save_checkpoint,
    should_consolidate,
    start_stage,
)
from rlflow.engine.train_state import step_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PPOInputs:
    """Model directories (local paths) the stage starts from."""

    policy: str  # the round's starting policy
    reference: str  # KL anchor (the SFT policy or the round's start, per ppo.reference)
    sft: str  # SFT policy, for eval/kl_to_sft
    reward_model: str | None  # the round's reward model; None: no reward source is the round's model
    score_norm: tuple[float, float] | None  # the reward model's (mean, std) on its reference set
    critic: str | None  # initial critic: the reward model or the policy (ppo.critic_init); None: critic-free


@dataclass
class PPOLoopState:
    """What the step loop carries across steps and resumes (JSON in the checkpoint's meta)."""

    best: float | None = None  # checkpoint.keep_best's metric at its best evaluated step
    best_step: int | None = None
    stopped_by_kl: bool = False  # ppo.stop_kl ended the round's PPO


def load_ppo_models(
    inputs: PPOInputs,
    model_cfg: ModelConfig,
    cfg: PPOConfig,
    gold: Callable[..., Any],
    runtime: Runtime,
    chat_template: str = "auto",
) -> PPOModels:
    """Actor and critic (if any) as trainable engines (from the round's inputs; a resume then loads
    its checkpoint's state into them), reference, SFT policy and reward model (if any) frozen.

    With model.lora the actor and critic train adapters; a reference that is the actor's starting
    policy is then the actor with its adapters off (no second copy of the weights)."""
    kw, lora = model_kwargs(model_cfg), model_cfg.lora_for("ppo")
    tokenizer = load_tokenizer(inputs.policy, model_cfg.trust_remote_code, chat_template=chat_template)
    view = lora is not None and inputs.reference == inputs.policy
    reference = None if view else runtime.frozen(lambda: load_policy(inputs.reference, **kw))
    reward_model = (
        None if inputs.reward_model is None else runtime.frozen(lambda: load_scalar_model(inputs.reward_model, **kw))
    )
    # The schedule is constant (no warmup, no decay); total_steps only shapes a cosine that never starts.
    actor_optim = OptimSpec(cfg.actor_lr, 0.0, 0, 0, cfg.max_grad_norm)
    critic_optim = OptimSpec(cfg.critic_lr, 0.0, 0, 0, cfg.max_grad_norm)
    actor = runtime.trainable("model", lambda: load_policy(inputs.policy, **kw), actor_optim, lora=lora)
    if lora is not None:  # PPO's first ratio must be 1: model.lora.dropout applies to SFT and DPO only
        disable_dropout(actor.model)
    if view:
        reference = AdaptersOffView(actor.model)
    sft = reference if inputs.sft == inputs.reference else runtime.frozen(lambda: load_policy(inputs.sft, **kw))
    scoring = ScoringModels(reward_model, inputs.score_norm, reference, sft, gold)
    critic = None
    if inputs.critic is not None:
        load_critic = lambda: load_scalar_model(inputs.critic, key="critic", **kw)  # noqa: E731
        critic = runtime.trainable("critic", load_critic, critic_optim, lora=lora)
        if lora is not None:
            disable_dropout(critic.model)
    return PPOModels(actor, critic, tokenizer, scoring, runtime)


def load_prompt_sets(tokenizer: Any, data: DataConfig, eval_cfg: EvalConfig, sink) -> tuple[PromptSet, PromptSet]:
    train, n_trunc, n_drop = encode_prompt_set(
        tokenizer,
        load_prompts(data.prompts, data.storage_options),
        data.max_prompt_tokens,
        data.prompt_overflow,
        data.prompts,
    )
    records = load_prompts(data.eval_prompts, data.storage_options)[: eval_cfg.num_prompts]
    records = records[: eval_cfg.curve_prompts or len(records)]  # the curve's fixed subset
    evals, e_trunc, e_drop = encode_prompt_set(
        tokenizer, records, data.max_prompt_tokens, data.prompt_overflow, data.eval_prompts
    )
    sink.log_metrics({"data/prompts_truncated": n_trunc + e_trunc, "data/prompts_dropped": n_drop + e_drop}, 0)
    return train, evals


def run_ppo_stage(
    ctx: StageContext,
    inputs: PPOInputs,
    model_cfg: ModelConfig,
    cfg: PPOConfig,
    eval_cfg: EvalConfig,
    data: DataConfig,
    checkpoint: CheckpointConfig,
    gold: Callable[..., Any],
    rollout: RolloutConfig = RolloutConfig(),
    rollout_devices: str | None = None,
    guards: PPOGuards = PPOGuards(),
    objective: Objective = Objective(),
    reward: RewardConfig = RewardConfig(),
) -> StageOutcome:
    """Run `cfg.steps` RL steps (fewer if rollout KL passes `cfg.stop_kl`), resuming if possible.
    `objective` picks the estimator (PPO, GRPO, RLOO, REINFORCE++), `reward` the reward sources.
    A KL breach, or a reward failure under reward.on_failure=pause, returns an unfinished outcome
    with `breach` set (a committed checkpoint, no final.json) instead."""
    if (done := completed_outcome(ctx)) is not None:
        return done
    resume, changed = start_stage(ctx)
    guard = StageGuard(ctx, resume)
    models = load_ppo_models(inputs, model_cfg, cfg, gold, ctx.runtime, data.chat_template)
    if model_cfg.lora_for("ppo"):
        for role, engine in (("actor", models.actor), ("critic", models.critic)):
            if engine is not None:
                ctx.sink.log_metrics(lora_metrics(role, engine.model), 0)
    prompts, eval_prompts = load_prompt_sets(models.tokenizer, data, eval_cfg, ctx.sink)
    run = PPORun(ctx, models, cfg, eval_cfg, checkpoint, eval_prompts, resume, changed, objective)
    step, saved_guards = 0, None
    if resume is not None:
        meta = restore_training_state(ctx, resume, trained_engines(models))
        run.controller.load_state_dict(meta["kl_controller"])
        step, run.state, saved_guards = resume, PPOLoopState(**meta["ppo_state"]), meta.get("guards")
    pool = start_reward_pool(reward)
    source = build_reward_source(reward, models.scoring, guards.fallback_rule, pool, ctx.runtime, model_cfg)
    run.safety = PPOSafety(guards, ctx.label, saved_guards, resume, run.controller, source)
    models.reward = source
    if rollout.mode == "server":
        log_path = os.path.join(tempfile.gettempdir(), f"rlflow-rollout-{ctx.identity[:12]}-rank{dist.rank()}.log")
        models.rollout = RolloutService.start(
            rollout, inputs.policy, models.tokenizer, models.actor, log_path, rollout_devices
        )
    try:
        with guard:
            while step < cfg.steps and not run.state.stopped_by_kl and not guard.stop_requested:
                step += 1
                guard.begin(step)
                for engine in trained_engines(models).values():
                    engine.poison_loss = guard.poisoned(step)
                last, breach = run.step(step, prompts, rollout.generate_batch, guard)
                last = last or guard.stop_requested
                if breach is not None:
                    guard.suspend()  # pausing commits a whole checkpoint
                    return run.pause(breach.step, breach)
                if guard.checkpoint_due(step, last) or run.state.best_step == step:
                    whole = should_consolidate(ctx, step, last) or run.state.best_step == step
                    guard.after_checkpoint(step, run.commit(step, whole))
    finally:
        if models.rollout is not None:
            models.rollout.close()
        if pool is not None:
            pool.close()
    if "eval/gold_score" not in run.metrics:  # resumed exactly at the last step: evaluate its policy
        eval_metrics, samples = run.evaluate()
        run.metrics.update(eval_metrics)
        ctx.sink.log_table("eval_samples.json", samples)
    summary = _summary(run.metrics, step, run.state) | run.safety.summary() | guard.early_stop_metrics()
    return finish(ctx, step, summary, resume, changed)


class PPORun:
    """What one PPO stage's step loop shares: models, KL controller, loop state, guards."""

    def __init__(
        self,
        ctx: StageContext,
        models: PPOModels,
        cfg: PPOConfig,
        eval_cfg: EvalConfig,
        checkpoint: CheckpointConfig,
        eval_prompts: PromptSet,
        resume: int | None,
        changed: tuple[str, ...],
        objective: Objective = Objective(),
    ):
        self.ctx, self.models, self.cfg, self.eval_cfg, self.checkpoint = ctx, models, cfg, eval_cfg, checkpoint
        self.objective = objective
        self.eval_prompts, self.resume, self.changed = eval_prompts, resume, changed
        self.controller = make_controller(cfg)
        self.state = PPOLoopState()
        self.safety: PPOSafety | None = None  # set once the resumed state is known
        self.committed = resume  # the newest step this stage holds: a pause commits its step only if needed
        self.metrics: dict[str, float] = {}
        self.started = time.monotonic()

    def evaluate(self):
        """Same prompts and seed at every evaluation, so steps compare fairly."""
        seed = step_seed(self.ctx.seed, self.ctx.round_index, 7)
        cfg, e = self.cfg, self.eval_cfg
        return run_evaluation(self.models, self.eval_prompts, e.sampling(cfg), seed, e.batch_size, e.num_logged_samples)

    def step(self, step: int, prompts: PromptSet, generate_batch: int, guard: StageGuard) -> tuple[bool, Breach | None]:
        """One PPO step with its evaluation and logging; returns (last step?, breach or None).
        A reward failure is raised before any update, so the step can run again on the fallback."""
        ctx, cfg, state = self.ctx, self.cfg, self.state
        args = (self.models, self.controller, cfg, prompts, ctx.seed, ctx.round_index, step, generate_batch)
        args += (self.objective,)
        try:
            metrics = ppo_step(*args)
        except RewardSourceError as exc:
            if (breach := self.safety.reward_failed(exc, step, self.metrics)) is not None:
                return False, breach
            metrics = ppo_step(*args)  # the same step again, scored by the fallback rule
        metrics |= guard.record_update(bool(metrics.pop("skipped")), step)
        state.stopped_by_kl = cfg.stop_kl is not None and metrics["actor/kl"] > cfg.stop_kl
        metrics["actor/stopped_by_kl"] = float(state.stopped_by_kl)
        breach = self.safety.observe(step, metrics, state.stopped_by_kl)
        last = step >= cfg.steps or state.stopped_by_kl
        if breach is None and (step % self.eval_cfg.every_steps == 0 or last):
            eval_metrics, samples = self.evaluate()
            metrics.update(eval_metrics)
            _track_best(state, self.checkpoint.keep_best, self.checkpoint.keep_best_mode, metrics, step)
            if last:
                ctx.sink.log_table("eval_samples.json", samples)
        metrics["timing_s/elapsed"] = time.monotonic() - self.started
        guard.end(step)
        if step % cfg.log_every == 0 or last or breach is not None:
            ctx.sink.log_metrics(metrics, step)
        self.metrics = metrics
        return last, breach

    def commit(self, at: int, whole: bool, breach: Breach | None = None) -> str:
        guards = self.safety.state_dict(breach)
        url = _commit(self.ctx, self.models, self.controller, self.state, guards, at, self.cfg.rollout_batch, whole)
        self.committed = at
        return url

    def pause(self, at: int, breach: Breach) -> StageOutcome:
        """Stop for an operator at committed step `at` (committed now, whole, if it is not yet)."""
        if self.committed != at:
            self.commit(at, True, breach)  # whole model directories: the operator may want to look at it
        log.warning("%s: %s", self.ctx.label, breach.message)
        summary = _summary(self.metrics, at, self.state) | self.safety.summary()
        return paused_outcome(self.ctx, breach, summary, self.resume, self.changed)


def _commit(
    ctx: StageContext,
    models: PPOModels,
    controller: Any,
    state: PPOLoopState,
    guards: dict[str, Any],
    step: int,
    rollout_batch: int,
    whole: bool,
) -> str:
    """Commit a PPO step: actor and critic, KL controller, loop state and the guards' state."""
    engines = {"model": (models.actor, models.tokenizer)}
    if models.critic is not None:
        engines["critic"] = (models.critic, None)
    return save_checkpoint(
        ctx,
        step,
        engines,
        {
            "kl_controller": controller.state_dict(),
            "ppo_state": dataclasses.asdict(state),
            "guards": guards,
            "data_position": {"prompts_seen": step * rollout_batch},
        },
        whole,
        protect={state.best_step} if state.best_step else set(),
    )


def trained_engines(models: PPOModels) -> dict[str, Any]:
    """The engines a checkpoint holds: the actor, and the critic if there is one."""
    return {"model": models.actor} | ({"critic": models.critic} if models.critic is not None else {})


def _summary(metrics: dict[str, float], step: int, state: PPOLoopState) -> dict[str, float]:
    keep = ("critic/score/mean", "actor/kl", "eval/gold_score", "eval/rm_score", "eval/kl", "response_length/mean")
    return {k: metrics[k] for k in keep if k in metrics} | {
        "ppo/steps": step,
        "ppo/stopped_by_kl": float(state.stopped_by_kl),
    }


def _track_best(state: PPOLoopState, metric: str | None, mode: str, metrics: dict[str, float], step: int) -> None:
    if not metric or metric not in metrics:
        return
    sign = 1.0 if mode == "max" else -1.0
    if state.best is None or sign * metrics[metric] > sign * state.best:
        state.best, state.best_step = metrics[metric], step
