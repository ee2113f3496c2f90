"""Thin Prefect tasks, one per stage: open the MLflow child run, call the engine, return a record.

Each task's cache key is the stage identity (config subtree + input manifests + data
fingerprints), so a re-run shows finished stages as Cached; the engine still checks the store's
`final` marker, which is the truth about completion.
"""

from __future__ import annotations

from dataclasses import replace
import os
from typing import Any, Callable

from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from prefect.transactions import get_transaction
from pydantic import BaseModel, ConfigDict

from rlflow.engine.stages.breaker import StageOverrides
from rlflow.engine.storage.checkpoint import CheckpointStore, model_location, stage_prefix
from rlflow.engine.config.schema import Config
from rlflow.engine.errors import StagePreempted
from rlflow.engine.backend.launch import DistributedJobError
from rlflow.engine.telemetry.metrics import FanoutSink, MetricsSink
from rlflow.engine.telemetry.progress import CallbackSink, EventLogSink, StopRequest, console_sink, events_path
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.backend.placement import devices_for
from rlflow.engine.stages.rl.stage import PPOInputs
from rlflow.engine.rewards.sources import FALLBACK_METRIC, declared_rule, judge_model_path
from rlflow.engine.rewards.model_scores import ScoreNorm
from rlflow.engine.stages.reward_model import score_norm_from_metrics
from rlflow.engine.stages.label_eval import (
    EvalInputs,
    EvalStageInputs,
    LabelStageInputs,
    run_eval_stage,
    run_label_stage,
)
from rlflow.engine.rewards.user_functions import load_bound_function, load_function
from rlflow.engine.stages.context import StageContext, StageOutcome
from rlflow.engine.stages.lifecycle import set_threads
from rlflow.engine.stages.worker import NOT_RETRIED, StageCall, make_context, run_stage_call
from rlflow.tasks.distributed import launch_training_stage
from rlflow.tasks.tracking import RunTracker, resolve_tracking_uri

PROGRESS_KEYS = {
    "sft": ("sft/loss", "sft/eval_loss", "sft/lr"),
    "rm": ("rm/loss", "rm/train_accuracy", "rm/accuracy", "rm/accuracy_online"),
    "ppo": (
        "critic/score/mean",
        "actor/kl",
        "actor/pg_loss",
        "critic/vf_loss",
        "response_length/mean",
        "eval/gold_score",
        "timing_s/step",
    ),
    "dpo": ("dpo/loss", "dpo/rewards/accuracy", "dpo/rewards/margin", "dpo/eval_accuracy"),
    "eval": ("eval/gold_score", "eval/rm_score", "eval/kl", "eval/distinct_2", "eval/valid_fraction"),
    "label": ("label/pairs", "label/ties_dropped"),
}


class StageResult(StageOutcome):
    """What a task returns (and Prefect persists as JSON): the engine's outcome and the stage's
    MLflow run; never tensors. A breach means PPO stopped for an operator: not finished
    (flows/breach.py handles it)."""

    mlflow_run_id: str | None = None


class StageSpec(BaseModel):
    """What a task needs besides the config: its place, identity and the MLflow parent run."""

    model_config = ConfigDict(frozen=True)

    stage: str
    round_index: int
    identity: str
    identity_tree: dict[str, Any]
    parent_run_id: str


def retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry what a rerun can fix (a hang, a crashed or OOM-killed
    rank, a flaky store), never an input error, a preemption (the machine is going away) or
    non-finite updates (deterministic: they would recur)."""
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, DistributedJobError):  # a rank's exit code says (engine/stages/worker.py)
        return exc.exit_code not in (2, StagePreempted.exit_code)
    return not isinstance(exc, (*NOT_RETRIED, StagePreempted))


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    spec: StageSpec = parameters["spec"]
    config: Config = parameters["config"]
    return f"rlflow-{config.run.name}-r{spec.round_index}-{spec.stage}-{spec.identity[:32]}"


def output_exists(config: Config, result: StageResult) -> bool:
    """Whether the store still holds the final output a (possibly cached) result points to."""
    store = CheckpointStore(
        stage_prefix(config.run.root, config.run.name, result.round_index, result.stage), config.run.storage_options
    )
    final = store.final()
    return final is not None and final["manifest_sha256"] == result.manifest_sha256


def _call(config: Config, spec: StageSpec, **inputs: Any) -> StageCall:
    prefix = stage_prefix(config.run.root, config.run.name, spec.round_index, spec.stage)
    where = {"stage": spec.stage, "store_url": prefix, "round_index": spec.round_index}
    return StageCall(**where, identity=spec.identity, identity_tree=spec.identity_tree, **inputs)


def _run_tracked(
    config: Config,
    spec: StageSpec,
    total_steps: int | None,
    body: Callable[[StageContext], StageOutcome] | None = None,
    **inputs: Any,
) -> StageResult:
    """Run a stage inside its MLflow child run. Training stages (no `body`) run their StageCall
    in this process (torch backend) or as a distributed job (deepspeed); label and eval run
    `body` in this process."""
    set_threads(config.run.threads)
    tracker = RunTracker(resolve_tracking_uri(config.tracking.uri, config.run.root), config.tracking.experiment)
    run_id = tracker.child_run(spec.parent_run_id, spec.round_index, spec.stage)
    in_process = body is not None or config.engine.backend != "deepspeed"
    stop = StopRequest() if in_process else None  # a distributed stage's ranks cannot hear a callback
    sink, call = stage_sinks(config, spec, total_steps, tracker.sink(run_id), stop), _call(config, spec, **inputs)
    try:
        if body is not None:
            outcome = body(replace(make_context(config, call, sink, Runtime(config.engine)), stop=stop))
        elif config.engine.backend == "deepspeed":
            outcome = launch_training_stage(config, call, sink, get_run_logger())
        else:
            outcome = run_stage_call(replace(make_context(config, call, sink), stop=stop), config, call)
    except BaseException:
        tracker.finish(run_id, "FAILED")
        raise
    finally:
        sink.close()
    tracker.set_tags(
        run_id,
        {
            "rlflow.checkpoint_uri": outcome.checkpoint_uri,
            "rlflow.identity": spec.identity,
            "rlflow.resumed_from": "" if outcome.resumed_from is None else str(outcome.resumed_from),
            "rlflow.backend": config.engine.backend if body is None else "torch",
            "rlflow.world_size": str(config.resources.world_size if body is None else 1),
        }
        # Params are immutable: a continued stage's changed keys go to a tag instead.
        | ({"rlflow.changed_keys": ",".join(outcome.changed_keys)} if outcome.changed_keys else {})
        | guard_tags(config, outcome),
    )
    # A breached stage is not finished: KILLED until the continued stage sets it RUNNING again.
    tracker.finish(run_id, "FINISHED" if outcome.breach is None else "KILLED")
    if outcome.breach is not None:
        _keep_out_of_cache()
    return StageResult(**dict(outcome), mlflow_run_id=run_id)


def stage_sinks(
    config: Config, spec: StageSpec, total_steps: int | None, mlflow_sink: MetricsSink, stop: StopRequest | None
) -> MetricsSink:
    """Where a stage's numbers go: the console (a bar or lines), MLflow, events.jsonl, then the
    user's callbacks, whose returned metrics go to the first three."""
    head = {"run": config.run.name, "round": spec.round_index, "stage": spec.stage}
    console = console_sink(f"round {spec.round_index} {spec.stage}", total_steps, PROGRESS_KEYS[spec.stage])
    events = EventLogSink(events_path(config.run.root, config.run.name), config.run.name, spec.round_index, spec.stage)
    recorded = FanoutSink(console, mlflow_sink, events)
    if not config.callbacks:
        return recorded
    callbacks = [(ref, load_function(ref, "callbacks")) for ref in config.callbacks]
    return CallbackSink(callbacks, recorded, head, stop)


def guard_tags(config: Config, outcome: StageOutcome) -> dict[str, str]:
    """Tags for what the guards did: the last breach, and a fallback reward (it changed the objective)."""
    tags = {}
    if outcome.breach is not None:
        tags["rlflow.breach"] = f"{outcome.breach.reason} at step {outcome.breach.step}"
    if outcome.metrics.get(FALLBACK_METRIC):
        rule = config.reward.fallback_rule
        tags["rlflow.reward_fallback"] = rule.fn if rule is not None else "(recorded in the checkpoint)"
    return tags


def _keep_out_of_cache() -> None:
    """A breach is not the stage's result: Prefect must not store it under the stage's cache key
    (its identity), or the next call, which continues the stage, would be served the breach."""
    transaction = get_transaction()  # the task run's own: its commit writes the cache record
    if transaction is not None:
        transaction.write_on_commit = False


STAGE_TASK = dict(
    cache_key_fn=_cache_key,
    persist_result=True,
    result_serializer="json",
    task_run_name="round-{spec.round_index}-{spec.stage}",
)


@task(name="sft", **STAGE_TASK)
def sft_task(config: Config, spec: StageSpec, init_uri: str) -> StageResult:
    return _run_tracked(config, spec, config.sft.max_steps, init_path=init_uri)


@task(name="label", **STAGE_TASK)
def label_task(config: Config, spec: StageSpec, policy_uri: str) -> StageResult:
    labeller = load_function(config.label.labeller.fn, "label.labeller.fn")
    return _run_tracked(
        config,
        spec,
        None,
        lambda ctx: run_label_stage(
            ctx,
            LabelStageInputs(
                policy_path=model_location(policy_uri, config.run.storage_options),
                model=config.model,
                data=config.data,
                sampling=config.sampling.params(),
                labeller=labeller,
                labeller_kwargs=config.label.labeller.kwargs,
                n_prompts=config.label.prompts_per_round,
                eval_fraction=config.label.eval_fraction,
            ),
        ),
    )


@task(name="rm", **STAGE_TASK)
def rm_task(
    config: Config, spec: StageSpec, init_uri: str, preference_files: list[str], eval_files: list[str] = ()
) -> StageResult:
    """`preference_files`: JSONL of pairs besides data.preferences (online labels, human labels);
    `eval_files`: held-out online labels (rm/accuracy_online)."""
    return _run_tracked(
        config,
        spec,
        None,
        init_path=init_uri,
        extra_preferences=tuple(preference_files),
        eval_preferences=tuple(eval_files),
    )


@task(name="dpo", **STAGE_TASK)
def dpo_task(
    config: Config, spec: StageSpec, init_uri: str, reference_uri: str, preference_files: list[str]
) -> StageResult:
    """DPO from `init_uri` against the frozen `reference_uri`; `preference_files`: the round's
    online-labelled pairs (JSONL), besides data.preferences when dpo.include_offline."""
    return _run_tracked(
        config,
        spec,
        None,
        init_path=init_uri,
        reference_path=reference_uri,
        extra_preferences=tuple(preference_files),
    )


def score_norm_of(rm: StageResult) -> ScoreNorm:
    """The reward model's (mean, std) on its fixed reference set (per head: an ensemble), recorded by its stage."""
    return score_norm_from_metrics(rm.metrics)


@task(name="ppo", **STAGE_TASK)
def ppo_task(
    config: Config,
    spec: StageSpec,
    inputs: dict[str, str],
    rm: StageResult | None,
    overrides: StageOverrides | None = None,
) -> StageResult:
    """The RL stage (PPO, GRPO, RLOO, REINFORCE++: algorithm.name). `rm`: the round's reward model,
    None when no reward source is the round's model. `overrides`: an operator's, continuing after a
    breach (not in the cache key: the same stage)."""
    critic = None  # critic-free estimators (the config ensures critic_init=rm comes with a reward model)
    if not config.algorithm.critic_free:
        critic = rm.checkpoint_uri if config.ppo.critic_init == "rm" else inputs["policy"]
    ppo_inputs = PPOInputs(  # checkpoint URIs: each process resolves them to local directories
        policy=inputs["policy"],
        reference=inputs["reference"],
        sft=inputs["sft"],
        reward_model=None if rm is None else rm.checkpoint_uri,
        score_norm=None if rm is None else score_norm_of(rm),
        critic=critic,
    )
    load_function(config.gold.fn, "gold.fn")  # fail here, before any process starts, if it is missing
    if config.reward.fallback_rule is not None:
        load_function(config.reward.fallback_rule.fn, "reward.fallback_rule.fn")
    devices = devices_for(config.placement.rollout, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _run_tracked(
        config,
        spec,
        config.ppo.steps,
        ppo_inputs=ppo_inputs,
        rollout_devices=devices,
        overrides=overrides or StageOverrides(),
    )


@task(name="eval", **STAGE_TASK)
def eval_task(config: Config, spec: StageSpec, inputs: dict[str, str], rm: StageResult | None) -> StageResult:
    """`rm`: the round's reward model (eval/rm_score); None in a round without one."""
    so = config.run.storage_options
    eval_inputs = EvalInputs(
        start_policy=model_location(inputs["policy"], so),
        final_policy=model_location(inputs["final"], so),
        reference=model_location(inputs["reference"], so),
        sft=model_location(inputs["sft"], so),
        reward_model=None if rm is None else model_location(rm.checkpoint_uri, so),
        score_norm=None if rm is None else score_norm_of(rm),
    )
    gold = load_bound_function(config.gold, "gold.fn")
    sampling = config.sampling.params(greedy=config.eval.greedy)
    reward = config.reward
    valid, judge = (declared_rule(reward, name) for name in (reward.valid, reward.judge))
    stage_inputs = EvalStageInputs(
        eval_inputs, config.model, config.data, config.eval, sampling, gold, config.env, valid, judge,
        judge_model_path(reward),
    )
    return _run_tracked(
        config,
        spec,
        None,
        lambda ctx: run_eval_stage(ctx, stage_inputs),
    )

