"""One thin Prefect task for every stage: open the MLflow child run, call the engine, return a record.

The task's cache key is the stage identity (the hash of its inputs record: engine/stages/identity.py),
so a re-run shows finished stages as Cached; the engine still checks the store's `final` marker,
which is the truth about completion.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from prefect.transactions import get_transaction
from pydantic import BaseModel, ConfigDict

from rlflow.engine.backend.launch import DistributedJobError
from rlflow.engine.backend.placement import devices_for
from rlflow.engine.config.schema import Config
from rlflow.engine.errors import StagePreempted
from rlflow.engine.rewards.sources import FALLBACK_METRIC
from rlflow.engine.rewards.user_functions import load_function
from rlflow.engine.stages.catalog import run_stage, stage_kind
from rlflow.engine.stages.context import Record, StageOutcome, StageOverrides
from rlflow.engine.stages.lifecycle import set_threads
from rlflow.engine.stages.worker import NOT_RETRIED, StageCall, call_inputs, make_context
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.telemetry.metrics import FanoutSink, MetricsSink
from rlflow.engine.telemetry.progress import CallbackSink, EventLogSink, StopRequest, console_sink, events_path
from rlflow.tasks.distributed import launch_training_stage
from rlflow.tasks.tracking import RunTracker, resolve_tracking_uri

PROGRESS_KEYS = {
    "sft": ("sft/loss", "sft/eval_loss", "sft/lr"),
    "rm": ("rm/loss", "rm/train_accuracy", "rm/accuracy", "rm/accuracy_online"),
    "rl": (
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


# The progress bar's length: the stage's most steps, where the config bounds them.
TOTAL_STEPS = {"sft": lambda c: c.sft.max_steps, "rl": lambda c: c.rl.steps}


class StageResult(StageOutcome):
    """What a task returns (and Prefect persists as JSON): the engine's outcome and the stage's
    MLflow run; never tensors. A breach means the RL stage stopped for an operator: not finished
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


def _call(config: Config, spec: StageSpec, upstream: Record, overrides: StageOverrides | None) -> StageCall:
    prefix = stage_prefix(config.run.root, config.run.name, spec.round_index, spec.stage)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = devices_for(config.placement.rollout, visible) if spec.stage == "rl" else None
    return StageCall(
        stage=spec.stage,
        store_url=prefix,
        round_index=spec.round_index,
        identity=spec.identity,
        identity_tree=spec.identity_tree,
        upstream=upstream.model_dump(mode="json"),
        rollout_devices=devices,
        overrides=overrides or StageOverrides(),
    )


@task(name="stage", cache_key_fn=_cache_key, persist_result=True, result_serializer="json",
      task_run_name="round-{spec.round_index}-{spec.stage}")
def stage_task(
    config: Config, spec: StageSpec, upstream: Record, overrides: StageOverrides | None = None
) -> StageResult:
    """Run one stage inside its MLflow child run: a training stage as a distributed job under
    engine.backend=deepspeed, everything else in this process. `upstream`: the stage's upstream
    record (engine/stages/catalog.py); `overrides`: an operator's, continuing the RL stage after a
    breach (not in the cache key: the same stage). The flow names each call after its stage."""
    set_threads(config.run.threads)
    tracker = RunTracker(resolve_tracking_uri(config.tracking.uri, config.run.root), config.tracking.experiment)
    run_id = tracker.child_run(spec.parent_run_id, spec.round_index, spec.stage)
    distributed = stage_kind(spec.stage).trains and config.engine.backend == "deepspeed"
    stop = None if distributed else StopRequest()  # a distributed stage's ranks cannot hear a callback
    total = TOTAL_STEPS[spec.stage](config) if spec.stage in TOTAL_STEPS else None
    sink, call = stage_sinks(config, spec, total, tracker.sink(run_id), stop), _call(config, spec, upstream, overrides)
    try:
        if distributed:
            outcome = launch_training_stage(config, call, sink, get_run_logger())
        else:
            ctx = make_context(config, call, sink, stop=stop)
            try:
                outcome = run_stage(ctx, call_inputs(config, call))
            finally:
                ctx.runtime.close()
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
            "rlflow.backend": config.engine.backend if distributed else "torch",
            "rlflow.world_size": str(config.resources.world_size if distributed else 1),
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
