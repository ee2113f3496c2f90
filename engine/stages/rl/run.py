"""The RL-run entry point: `RLRun.open(runtime, inputs)` builds everything one RL step needs from the
stage's inputs record (engine/stages/rl/inputs.py), and `run.step(n)` runs step n.

What it builds: the actor and critic (trainable), the reference, SFT policy and reward model
(frozen), the objective, the reward sources and their worker pool, the training and evaluation
prompts, the KL controller and, with an `env`, the episode sampler. The RL stage
(engine/stages/rl/stage.py), `rlflow probe` (engine/estimate/probe.py), infra/gpu_check.py, the bench
scripts and the tests all open their steps here: nothing else builds a step by hand
(tests/test_rl_entry.py checks it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlflow.engine.backend.runtime import OptimSpec, Runtime, TrainEngine
from rlflow.engine.data.prompts import PromptSet, encode_prompt_set
from rlflow.engine.data.records import load_prompts
from rlflow.engine.models.loading import disable_dropout, load_policy, load_scalar_model, load_tokenizer, model_kwargs
from rlflow.engine.models.lora import AdaptersOffView, lora_metrics
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.rewards.sources import build_reward_source, named_source, source_scorer, start_reward_pool
from rlflow.engine.rewards.user_functions import load_bound_function
from rlflow.engine.rollout.episodes import EpisodeSampler, Journal
from rlflow.engine.rollout.service import AheadStart, RolloutService
from rlflow.engine.seeds import step_seed
from rlflow.engine.stages.evaluation import PolicyEvaluation, evaluate_policy
from rlflow.engine.stages.rl.experience import Objective, RLModels, assemble_experience
from rlflow.engine.stages.rl.inputs import RLInputs
from rlflow.engine.stages.rl.step import (
    after_update,
    make_controller,
    rl_update,
    rollout_plan,
    sample_step,
    single_pass_possible,
    single_pass_update,
    stream_prompts,
    with_timings,
)
from rlflow.engine.telemetry.phases import collect_phases
from rlflow.engine.telemetry.metrics import MetricsSink, NullSink

if TYPE_CHECKING:
    from rlflow.engine.rewards.pool import RewardFunctionPool

log = logging.getLogger(__name__)


def load_rl_models(inputs: RLInputs, runtime: Runtime) -> RLModels:
    """Actor and critic (if any) as trainable engines (from the round's inputs; a resume then loads
    its checkpoint's state into them), reference, SFT policy and reward model (if any) frozen.

    With model.lora the actor and critic train adapters; a reference that is the actor's starting
    policy is then the actor with its adapters off (no second copy of the weights)."""
    up, rl, lora = inputs.upstream, inputs.rl, inputs.model.lora
    kw = model_kwargs(inputs.model)
    tokenizer = load_tokenizer(up.policy.uri, inputs.model.trust_remote_code, chat_template=inputs.data.chat_template)
    view = lora is not None and up.reference.uri == up.policy.uri
    reference = None if view else runtime.frozen(lambda: load_policy(up.reference.uri, **kw))
    rm = up.reward_model
    reward_model = None if rm is None else runtime.frozen(lambda: load_scalar_model(rm.uri, **kw))
    # The schedule is constant (no warmup, no decay); total_steps only shapes a cosine that never starts.
    actor = runtime.trainable(
        "model",
        lambda: load_policy(up.policy.uri, **kw),
        OptimSpec(rl.actor_lr, 0.0, 0, 0, rl.max_grad_norm),
        lora=lora,
    )
    if lora is not None:  # the first ratio must be 1: model.lora.dropout applies to SFT and DPO only
        disable_dropout(actor.model)
    if view:
        reference = AdaptersOffView(actor.model)
    sft = reference if up.sft.uri == up.reference.uri else runtime.frozen(lambda: load_policy(up.sft.uri, **kw))
    gold = load_bound_function(inputs.gold, "gold.fn")
    valid = source_scorer(named_source(inputs.reward, inputs.reward.valid), inputs.reward.on_error)
    scoring = ScoringModels(reward_model, None if rm is None else rm.score_norm, reference, sft, gold, valid=valid)
    critic = None
    if up.critic is not None:
        load_critic = lambda: load_scalar_model(up.critic.uri, key="critic", heads=1, **kw)  # noqa: E731
        critic_optim = OptimSpec(inputs.ppo.critic_lr, 0.0, 0, 0, rl.max_grad_norm)
        critic = runtime.trainable("critic", load_critic, critic_optim, lora=lora)
        if lora is not None:
            disable_dropout(critic.model)
    return RLModels(actor, critic, tokenizer, scoring, runtime)


def load_prompt_sets(
    tokenizer: Any, inputs: RLInputs, sink: MetricsSink, episodes: EpisodeSampler | None = None
) -> tuple[PromptSet, PromptSet]:
    """The RL prompts and the evaluation's, with data.max_prompt_tokens applied (to each episode's
    first messages when `episodes`); data/prompts_truncated and data/prompts_dropped are logged."""
    data, eval_cfg = inputs.data, inputs.eval
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


@dataclass
class RLRun:
    """Everything one RL stage's steps run on (see the module docstring); close it (or use `with`)."""

    inputs: RLInputs
    models: RLModels
    objective: Objective
    controller: Any  # engine/algorithms/kl.py KL_CONTROLLERS
    prompts: PromptSet  # what the steps sample
    eval_prompts: PromptSet  # what the evaluations sample
    round_index: int
    pool: RewardFunctionPool | None  # the rule and function sources' worker processes

    @classmethod
    def open(
        cls,
        runtime: Runtime,
        inputs: RLInputs,
        round_index: int = 0,
        sink: MetricsSink | None = None,
        journal: Journal | None = None,
        restore: Callable[[RLRun], None] | None = None,
    ) -> RLRun:
        """Load the models and prompts, then (`restore`: a resumed stage puts its checkpoint's state
        into the engines and the controller here) start the reward pool and build the reward source.
        `journal`: where an episode's tool results are kept, so a killed step replays them."""
        sink = sink or NullSink()
        models = load_rl_models(inputs, runtime)
        if inputs.model.lora is not None:
            for role, engine in (("actor", models.actor), ("critic", models.critic)):
                if engine is not None:
                    sink.log_metrics(lora_metrics(role, engine.model), 0)
        episodes = None
        if inputs.env is not None:
            episodes = EpisodeSampler(inputs.env, models.tokenizer, journal, inputs.data.max_prompt_tokens)
        prompts, eval_prompts = load_prompt_sets(models.tokenizer, inputs, sink, episodes)
        models = dataclasses.replace(models, episodes=episodes)
        run = cls(inputs, models, Objective.of(inputs), make_controller(inputs.kl), prompts, eval_prompts,
                  round_index, None)
        if restore is not None:
            restore(run)
        run.pool = start_reward_pool(inputs.reward)
        try:
            source = build_reward_source(
                inputs.reward, models.scoring, inputs.reward.fallback_rule, run.pool, runtime, inputs.model
            )
        except BaseException:
            run.close()
            raise
        run.models = dataclasses.replace(run.models, reward=source)
        return run

    def start_rollout(
        self, done_steps: int = 0, ahead: dict | None = None, log_path: str | None = None, devices: str | None = None
    ) -> None:
        """rollout.mode=server: sample from a worker process from now on, started from the actor's
        current weights (policy version `done_steps`) with `ahead`, the steps a resumed off-policy
        run had sampled ahead; `devices`: the worker's CUDA_VISIBLE_DEVICES (placement.rollout)."""
        inputs, models, prompts = self.inputs, self.models, self.prompts
        cfg, rl, seed = inputs.rollout, inputs.rl, inputs.seed
        plan = rollout_plan(prompts, rl, self.objective, seed, self.round_index, cfg.generate_batch)
        index_of = stream_prompts(len(prompts.token_ids), rl, seed, self.round_index)
        prompt_of = lambda group: prompts.token_ids[index_of(group)]  # noqa: E731
        stream_seed = step_seed(seed, self.round_index, 12)
        start = AheadStart(plan, rl.steps, done_steps, ahead or {}, prompt_of, rl.rollout_batch, stream_seed)
        policy = inputs.upstream.policy.uri
        service = RolloutService.start(cfg, policy, models.tokenizer, models.actor, log_path, devices, start)
        self.models = dataclasses.replace(models, rollout=service)

    @property
    def engines(self) -> dict[str, TrainEngine]:
        """The engines a checkpoint holds: the actor, and the critic if there is one."""
        models = self.models
        return {"model": models.actor} | ({"critic": models.critic} if models.critic is not None else {})

    def step(self, step: int) -> dict[str, float]:
        """RL step `step` (1-based): rollout of rl.rollout_batch prompts x rollout.n samples each,
        scoring, the actor's (and critic's) updates, the KL controller. Returns its metrics, with
        timing_s/{gen,old_logprobs,ref,values,reward,update_actor,update_critic,other,step}."""
        models, cfg, objective, seed = self.models, self.inputs.rl, self.objective, self.inputs.seed
        started = time.monotonic()
        with collect_phases() as timings:  # every phase below adds its seconds (engine/telemetry/phases.py)
            update_actor = step > objective.critic_warmup_steps or models.critic is None
            if models.episodes is not None and models.episodes.journal is not None:
                models.episodes.journal.begin(step)
            single = single_pass_possible(models, cfg, update_actor, objective.group_size)
            generate_batch = self.inputs.rollout.generate_batch
            rollout, sampled = sample_step(
                models, cfg, self.prompts, seed, self.round_index, step, generate_batch, objective, single
            )
            coef = self.controller.value
            if single:
                exp, updated = single_pass_update(models, rollout, cfg, coef, step, objective)
            else:
                exp = assemble_experience(rollout, rollout.old_logprobs, rollout.values, coef, cfg, objective)
                update_seed = step_seed(seed, self.round_index, step, 5)
                updated = rl_update(models, exp, cfg, update_actor, update_seed, step, objective)
            metrics = after_update(models, self.controller, exp, coef, objective, step) | updated | sampled
        return with_timings(metrics, timings, time.monotonic() - started, exp)

    def evaluate(self) -> PolicyEvaluation:
        """The evaluation prompts, with the same seed at every evaluation so that steps compare fairly."""
        e = self.inputs.eval
        return evaluate_policy(
            self.models.actor.model,
            self.models.tokenizer,
            self.eval_prompts,
            self.models.scoring,
            self.inputs.sampling.params(greedy=e.greedy),
            step_seed(self.inputs.seed, self.round_index, 7),
            e.batch_size,
            e.num_logged_samples,
            self.models.runtime.generate_kwargs(),
            self.models.episodes,
        )

    def close(self) -> None:
        """Stop the rollout worker and the reward pool (what holds processes)."""
        try:
            if self.models.rollout is not None:
                self.models.rollout.close()
        finally:
            if self.pool is not None:
                self.pool.close()

    def __enter__(self) -> RLRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
