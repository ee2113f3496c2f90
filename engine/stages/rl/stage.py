"""The PPO stage: load the four models, run PPO steps with checkpoints, evaluations, KL stop and
the guards (KL circuit breaker, reward-source failures: engine/stages/breaker.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlflow.engine.config.schema import DataConfig
from rlflow.engine.config.execution import RolloutConfig
from rlflow.engine.config.execution import CheckpointConfig
from rlflow.engine.config.stages import EvalConfig
from rlflow.engine.config.stages import PPOConfig
from rlflow.engine.config.kl import KLConfig
from rlflow.engine.config.sampling import SamplingConfig
from rlflow.engine.config.methods import RewardConfig
from rlflow.engine.config.model import ModelConfig
from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.hacking import HackingConfig
from rlflow.engine.promotion.hacking import DetectorLimits, candidate_step, detect_divergence, window_changes
from rlflow.engine.data.records import load_prompts
from rlflow.engine.stages.evaluation import PromptSet, encode_prompt_set
from rlflow.engine.rewards.model_scores import ScoreNorm, ScoringModels
from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import OptimSpec, Runtime
from rlflow.engine.stages.breaker import PPOGuards, PPOSafety, paused_outcome
from rlflow.engine.stages.context import Breach
from rlflow.engine.errors import RewardSourceError
from rlflow.engine.rollout.episodes import EpisodeSampler
from rlflow.engine.stages.rl.tool_journal import ToolJournal
from rlflow.engine.rollout.service import AheadStart, RolloutService
from rlflow.engine.models.loading import (
    disable_dropout,
    load_policy,
    load_scalar_model,
    load_tokenizer,
    model_kwargs,
)
from rlflow.engine.stages.rl.experience import Objective, PPOModels
from rlflow.engine.models.lora import AdaptersOffView, lora_metrics
from rlflow.engine.rewards.sources import build_reward_source, declared_rule, start_reward_pool
from rlflow.engine.stages.rl.step import make_controller, ppo_step, rollout_plan, run_evaluation, stream_prompts
from rlflow.engine.backend.runtime import TrainEngine
from rlflow.engine.stages.loop import StageStart, StepReport, run_stage_loop, training_stage
from rlflow.engine.stages.context import StageContext, StageOutcome
from rlflow.engine.stages.lifecycle import (
    finish,
    restore_training_state,
    save_checkpoint,
)
from rlflow.engine.seeds import step_seed

log = logging.getLogger(__name__)

ROLLOUT_BUFFER_FILE = "rollout_buffer.json"  # rollout.off_policy_steps > 0 or async: what was sampled ahead


@dataclass(frozen=True)
class PPOInputs:
    """Model directories (local paths) the stage starts from."""

    policy: str  # the round's starting policy
    reference: str  # KL anchor (the SFT policy or the round's start, per kl.reference)
    sft: str  # SFT policy, for eval/kl_to_sft
    reward_model: str | None  # the round's reward model; None: no reward source is the round's model
    score_norm: ScoreNorm | None  # the reward model's (mean, std) on its reference set (per head: an ensemble)
    critic: str | None  # initial critic: the reward model or the policy (ppo.critic_init); None: critic-free


@dataclass
class PPOLoopState:
    """What the step loop carries across steps and resumes (JSON in the checkpoint's meta)."""

    best: float | None = None  # checkpoint.keep_best's metric at its best evaluated step
    best_step: int | None = None
    stopped_by_kl: bool = False  # kl.stop_above ended the round's RL
    hacking_history: list[list[float | None]] = field(default_factory=list)  # [step, proxy, judge, valid, spread]
    hacking_window_start: int | None = None  # the detector stopped the RL: the diverged window's first step


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
        load_critic = lambda: load_scalar_model(inputs.critic, key="critic", heads=1, **kw)  # noqa: E731
        critic = runtime.trainable("critic", load_critic, critic_optim, lora=lora)
        if lora is not None:
            disable_dropout(critic.model)
    return PPOModels(actor, critic, tokenizer, scoring, runtime)


def load_prompt_sets(
    tokenizer: Any, data: DataConfig, eval_cfg: EvalConfig, sink, episodes: EpisodeSampler | None = None
) -> tuple[PromptSet, PromptSet]:
    """The RL prompts and the evaluation's, with data.max_prompt_tokens applied (to each episode's
    first messages when `episodes`); data/prompts_truncated and data/prompts_dropped are logged."""
    train, n_trunc, n_drop = encode_prompt_set(
        tokenizer,
        load_prompts(data.prompts, data.storage_options),
        data.max_prompt_tokens,
        data.prompt_overflow,
        data.prompts,
        episodes,
    )
    records = load_prompts(data.eval_prompts, data.storage_options)[: eval_cfg.num_prompts]
    records = records[: eval_cfg.curve_prompts or len(records)]  # the curve's fixed subset
    evals, e_trunc, e_drop = encode_prompt_set(
        tokenizer, records, data.max_prompt_tokens, data.prompt_overflow, data.eval_prompts, episodes
    )
    sink.log_metrics({"data/prompts_truncated": n_trunc + e_trunc, "data/prompts_dropped": n_drop + e_drop}, 0)
    if n_trunc + e_trunc + n_drop + e_drop:  # a truncated episode prompt loses its tool instructions first
        log.warning("%d prompts truncated to their last data.max_prompt_tokens=%d tokens, %d dropped (%s, %s)",
                    n_trunc + e_trunc, data.max_prompt_tokens, n_drop + e_drop, data.prompts, data.eval_prompts)
    return train, evals


@dataclass(frozen=True)
class RLStageInputs:
    """What the RL stage needs, built once by the worker (engine/stages/worker.py)."""

    paths: PPOInputs  # the model directories the stage starts from, and the reward model's score norm
    model: ModelConfig  # model.*: loading options and LoRA
    ppo: PPOConfig  # ppo.*: steps, batch sizes, learning rates, clipping
    kl: KLConfig  # kl.*: the controller of the reward penalty, the planned stop (the breaker is in guards)
    sampling: SamplingConfig  # sampling.*: what evaluations sample with unless eval.greedy
    eval: EvalConfig  # eval.*: the evaluation prompts and cadence
    data: DataConfig  # data.prompts and data.eval_prompts, chat template, storage options
    checkpoint: CheckpointConfig  # checkpoint.keep_best(_mode): the step protected from pruning
    gold: Callable[..., Any]  # the gold score (gold.fn), called by evaluations only
    objective: Objective  # the advantage estimator, group size, the KL's place, rollout sampling
    rollout: RolloutConfig = RolloutConfig()  # rollout.*: colocated or server sampling, generate_batch
    rollout_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the rollout worker (placement.rollout)
    guards: PPOGuards = PPOGuards()  # the KL breaker and reward-failure settings, with an operator's overrides
    reward: RewardConfig = RewardConfig()  # reward.*: the reward sources and their worker pool
    env: EnvConfig | None = None  # env.*: each prompt an episode of this environment (multi-turn, tools)
    hacking: HackingConfig = HackingConfig()  # hacking.*: the reward-hacking detector


@training_stage
def run_ppo_stage(ctx: StageContext, inputs: RLStageInputs, start: StageStart) -> StageOutcome:
    """Run `ppo.steps` RL steps (fewer if rollout KL passes `kl.stop_above`), resuming if possible.
    `inputs.objective` picks the estimator (PPO, GRPO, RLOO, REINFORCE++), `inputs.reward` the
    reward sources. A KL breach, or a reward failure under reward.on_failure=pause, returns an
    unfinished outcome with `breach` set (a committed checkpoint, no final.json) instead."""
    resume, changed, guard = start
    chat_template = inputs.data.chat_template
    models = load_ppo_models(inputs.paths, inputs.model, inputs.ppo, inputs.gold, ctx.runtime, chat_template)
    valid = declared_rule(inputs.reward, inputs.reward.valid)  # the evaluations' valid share
    models = dataclasses.replace(models, scoring=dataclasses.replace(models.scoring, valid=valid))
    if inputs.model.lora_for("ppo"):
        for role, engine in (("actor", models.actor), ("critic", models.critic)):
            if engine is not None:
                ctx.sink.log_metrics(lora_metrics(role, engine.model), 0)
    episodes = None
    if inputs.env is not None:  # its journal lets a killed step replay its tools' outputs
        journal = ToolJournal(ctx.store, ctx.identity, dist.rank())
        episodes = EpisodeSampler(inputs.env, models.tokenizer, journal, inputs.data.max_prompt_tokens)
    prompt_sets = load_prompt_sets(models.tokenizer, inputs.data, inputs.eval, ctx.sink, episodes)
    controller, state, saved_guards = make_controller(inputs.kl), PPOLoopState(), None
    if resume is not None:
        meta = restore_training_state(ctx, resume, trained_engines(models))
        controller.load_state_dict(meta["kl_controller"])
        state, saved_guards = PPOLoopState(**meta["ppo_state"]), meta.get("guards")
    pool, service = start_reward_pool(inputs.reward), None
    try:
        fallback = inputs.guards.fallback_rule
        source = build_reward_source(inputs.reward, models.scoring, fallback, pool, ctx.runtime, inputs.model)
        safety = PPOSafety(inputs.guards, ctx.label, saved_guards, resume, controller, source)
        service = _start_rollout_service(ctx, inputs, models, prompt_sets[0], resume)  # takes the restored actor
        models = dataclasses.replace(models, reward=source, rollout=service, episodes=episodes)
        run = PPORun(ctx, models, inputs, prompt_sets, RLStart(resume, changed, controller, state, safety))
        end = run_stage_loop(ctx, guard, run, resume or 0)
        if end.paused is not None:
            return end.paused
        step = end.step
        if episodes is not None:
            episodes.journal.clear()
    finally:
        if service is not None:
            service.close()
        if pool is not None:
            pool.close()
    if run.state.hacking_window_start is not None:  # the detector stopped it: roll back
        candidate, summary = _hacking_candidate(ctx, run.state, step)
        return finish(ctx, candidate, summary | run.safety.summary(), resume, changed)
    if "eval/gold_score" not in run.metrics:  # resumed exactly at the last step: evaluate its policy
        evaluation = run.evaluate()
        run.metrics.update(evaluation.metrics)
        ctx.sink.log_table("eval_samples.json", evaluation.samples)
    summary = _summary(run.metrics, step, run.state) | run.safety.summary() | guard.early_stop_metrics()
    return finish(ctx, step, summary, resume, changed)


def _hacking_candidate(ctx: StageContext, state: PPOLoopState, step: int) -> tuple[int, dict[str, float]]:
    """The stage's output after a divergence: checkpoint.keep_best's best step (e.g. on the judge)
    when it precedes the diverged window, else the last committed step before it, or, when none
    precedes it, the step the detector stopped at (the promotion gates judge it)."""
    window_start = state.hacking_window_start
    candidate = candidate_step(ctx.store.committed_steps(), window_start)
    if state.best_step is not None and state.best_step < window_start:  # kept whole and unpruned
        candidate = state.best_step
    if candidate is None:
        log.warning("%s: no checkpoint precedes the diverged window (steps %d-%d); the candidate is step %d",
                    ctx.label, window_start, step, step)
        candidate = step
    summary = {"ppo/steps": candidate, "ppo/stopped_by_kl": float(state.stopped_by_kl), "hacking/diverged": 1.0}
    return candidate, summary | {"hacking/stopped_at": step, "hacking/window_start": window_start}


def _start_rollout_service(
    ctx: StageContext, inputs: RLStageInputs, models: PPOModels, prompts: PromptSet, resume: int | None
) -> RolloutService | None:
    """rollout.mode=server: the sampling worker, started from the actor's current weights (policy
    version `resume`), with the steps a resumed off-policy run had sampled ahead."""
    if inputs.rollout.mode != "server":
        return None
    log_path = os.path.join(tempfile.gettempdir(), f"rlflow-rollout-{ctx.identity[:12]}-rank{dist.rank()}.log")
    policy, devices, cfg = inputs.paths.policy, inputs.rollout_devices, inputs.rollout
    buffer = {}
    if resume is not None and cfg.samples_ahead and dist.is_main():
        buffer = ctx.store.read_json(resume, ROLLOUT_BUFFER_FILE)
    plan = rollout_plan(prompts, inputs.ppo, inputs.objective, ctx.seed, ctx.round_index, cfg.generate_batch)
    index_of = stream_prompts(len(prompts.token_ids), inputs.ppo, ctx.seed, ctx.round_index)
    prompt_of = lambda group: prompts.token_ids[index_of(group)]  # noqa: E731
    stream_seed = step_seed(ctx.seed, ctx.round_index, 12)
    ahead = AheadStart(plan, inputs.ppo.steps, resume or 0, buffer, prompt_of, inputs.ppo.rollout_batch, stream_seed)
    return RolloutService.start(cfg, policy, models.tokenizer, models.actor, log_path, devices, ahead)


@dataclass(frozen=True)
class RLStart:
    """Where this run of the stage starts: fresh (resume None) or at a resumed step, with the KL
    controller and loop state restored from it and the guards (an operator's overrides applied)."""

    resume: int | None
    changed: tuple[str, ...]  # identity keys changed under resume.allow_config_change
    controller: Any  # engine/algorithms/kl.py KL_CONTROLLERS
    state: PPOLoopState
    safety: PPOSafety


class PPORun:
    """The RL stage's part of the stage loop (engine/stages/loop.py): models, KL controller, loop
    state and guards; each step's rollout, scoring and updates, the KL stop, the breaker and the
    evaluations."""

    def __init__(
        self,
        ctx: StageContext,
        models: PPOModels,
        inputs: RLStageInputs,
        prompt_sets: tuple[PromptSet, PromptSet],  # training, evaluation
        start: RLStart,
    ):
        self.ctx, self.models, self.cfg, self.eval_cfg = ctx, models, inputs.ppo, inputs.eval
        self.checkpoint, self.kl, self.objective = inputs.checkpoint, inputs.kl, inputs.objective
        self.hacking, self.valid_source, self.judge_source = inputs.hacking, inputs.reward.valid, inputs.reward.judge
        self.generate_batch = inputs.rollout.generate_batch
        self.eval_sampling = inputs.sampling.params(greedy=inputs.eval.greedy)
        (self.prompts, self.eval_prompts), self.resume, self.changed = prompt_sets, start.resume, start.changed
        self.controller, self.state, self.safety = start.controller, start.state, start.safety
        self.committed = start.resume  # the newest step this stage holds: a pause commits its step only if needed
        self.metrics: dict[str, float] = {}

    def evaluate(self):
        """Same prompts and seed at every evaluation, so steps compare fairly."""
        seed = step_seed(self.ctx.seed, self.ctx.round_index, 7)
        e = self.eval_cfg
        return run_evaluation(self.models, self.eval_prompts, self.eval_sampling, seed, e.batch_size,
                              e.num_logged_samples)

    @property
    def engines(self) -> tuple[TrainEngine, ...]:
        return tuple(trained_engines(self.models).values())

    def more(self, step: int) -> bool:
        state = self.state
        return step < self.cfg.steps and not state.stopped_by_kl and state.hacking_window_start is None

    def watch_hacking(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Record this step's signals, return hacking/*; on a divergence mark the window it began."""
        h, state = self.hacking, self.state
        signal = lambda name: None if name is None else metrics.get(f"reward/{name}/mean")  # noqa: E731
        row = [step, metrics.get("critic/score/mean"), signal(self.judge_source), signal(self.valid_source)]
        state.hacking_history.append(row + [metrics.get("critic/score_std_ensemble")])
        limits = DetectorLimits(h.window, h.min_judge_drop, h.max_valid_drop, h.max_spread_ratio)
        divergence = detect_divergence(state.hacking_history, limits)
        out = window_changes(state.hacking_history, h.window) | {"hacking/diverged": float(divergence is not None)}
        if divergence is not None:
            state.hacking_window_start = divergence.window_start
            where = f"the candidate is the last checkpoint before step {divergence.window_start}"
            log.warning("%s: %s; %s", self.ctx.label, divergence.message, where)
        return out

    def update(self, step: int) -> dict[str, float] | Breach:
        """One RL step's rollout, scoring and updates. A reward failure is raised before any update,
        so the step can run again on the fallback rule (or pause: the Breach)."""
        step_once = functools.partial(
            ppo_step,
            self.models,
            self.controller,
            self.cfg,
            self.prompts,
            seed=self.ctx.seed,
            round_index=self.ctx.round_index,
            step=step,
            generate_batch=self.generate_batch,
            objective=self.objective,
        )
        try:
            return step_once()
        except RewardSourceError as exc:
            if (breach := self.safety.reward_failed(exc, step, self.metrics)) is not None:
                return breach
            return step_once()  # the same step again, scored by the fallback rule

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        """The KL stop and breaker, and the evaluation every eval.every_steps and at the end."""
        cfg, state = self.cfg, self.state
        stop = self.kl.stop_above
        state.stopped_by_kl = stop is not None and metrics["actor/kl"] > stop
        metrics["actor/stopped_by_kl"] = float(state.stopped_by_kl)
        if self.hacking.enabled:
            metrics |= self.watch_hacking(step, metrics)
        breach = self.safety.observe(step, metrics, state.stopped_by_kl)
        last = step >= cfg.steps or state.stopped_by_kl or state.hacking_window_start is not None
        if breach is None and (step % self.eval_cfg.every_steps == 0 or last):
            evaluation = self.evaluate()
            metrics.update(evaluation.metrics)
            _track_best(state, self.checkpoint.keep_best, self.checkpoint.keep_best_mode, metrics, step)
            if last:
                self.ctx.sink.log_table("eval_samples.json", evaluation.samples)
        self.metrics = metrics
        log = step % cfg.log_every == 0 or last
        return StepReport(metrics, last or stopping, log, keep=state.best_step == step, breach=breach)

    def commit(self, at: int, whole: bool, last: bool = False, breach: Breach | None = None) -> str:
        guards = self.safety.state_dict(breach)
        recent: set[int] = set()
        if self.hacking.enabled:  # a rollback target: whole, and kept while a later window can still diverge
            whole, reach = True, self.hacking.window + self.ctx.every_steps
            recent = {s for s in self.ctx.store.committed_steps() if s >= at - reach}
        state, batch = self.state, self.cfg.rollout_batch
        url = _commit(self.ctx, self.models, self.controller, state, guards, at, batch, whole, recent)
        self.committed = at
        return url

    def pause(self, breach: Breach) -> StageOutcome:
        """Stop for an operator at committed step breach.step (committed now, whole, if it is not yet)."""
        at = breach.step
        if self.committed != at:
            self.commit(at, True, breach=breach)  # whole model directories: the operator may want to look at it
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
    protect: set[int] = frozenset(),
) -> str:
    """Commit a PPO step: actor and critic, KL controller, loop state and the guards' state;
    `protect`: older steps pruning must keep (besides keep_best's)."""
    engines = {"model": (models.actor, models.tokenizer)}
    if models.critic is not None:
        engines["critic"] = (models.critic, None)
    files = {}
    if models.rollout is not None and models.rollout.cfg.samples_ahead:  # what was sampled ahead
        files[ROLLOUT_BUFFER_FILE] = models.rollout.state_dict()
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
        protect=({state.best_step} if state.best_step else set()) | set(protect),
        files=files,
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
