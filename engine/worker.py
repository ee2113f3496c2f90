"""Run one training stage: in this process (torch backend) or as every rank of a distributed job.

`python -m rlflow.engine.worker SPEC.json` is what the launcher starts on each rank. The spec
holds the config with secrets redacted (their values come from $RLFLOW_SECRETS), the stage's
identity and its inputs; rank 0 reports metrics as event lines on stdout and writes the outcome
to the spec's `outcome_path`. The same `run_stage_call` serves the in-process path, so the two
cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import fsspec

from rlflow.engine import dist
from rlflow.engine.backend import Runtime, make_runtime
from rlflow.engine.breaker import PPOGuards, StageOverrides
from rlflow.engine.checkpoint import CheckpointStore, model_location
from rlflow.engine.config import Config, build_config
from rlflow.engine.dpo import run_dpo_stage
from rlflow.engine.secrets import merge_trees
from rlflow.engine.metrics import EventSink, NullSink
from rlflow.engine.mirror import make_mirror
from rlflow.engine.experience import Objective
from rlflow.engine.ppo_stage import PPOInputs, run_ppo_stage
from rlflow.engine.reward_model import run_reward_model_stage
from rlflow.engine.scoring import load_bound_function
from rlflow.engine.sft import run_sft_stage
from rlflow.engine.stage import StageContext, StageOutcome, set_threads
from rlflow.engine.errors import NonFiniteUpdates, RewardSourceError, RlflowError, StagePreempted
from rlflow.engine.stage_guard import GuardLimits

# Errors a rerun would meet again (bad input, deterministic divergence): never retried.
NOT_RETRIED = (RlflowError, NonFiniteUpdates, RewardSourceError)
SECRETS_ENV = "RLFLOW_SECRETS"  # JSON tree of the config's secret values; never written to a file
TRAINING_STAGES = ("sft", "rm", "ppo", "dpo")


@dataclass(frozen=True)
class StageCall:
    """One training stage to run, in JSON-friendly fields."""

    stage: str  # one of TRAINING_STAGES
    store_url: str  # the stage's checkpoint prefix
    round_index: int
    identity: str
    identity_tree: dict[str, Any]
    init_path: str = ""  # sft, rm, dpo: the model to start from (a directory or a committed step URI)
    extra_preferences: tuple[str, ...] = ()  # rm, dpo: online-labelled pairs
    eval_preferences: tuple[str, ...] = ()  # rm: held-out online-labelled pairs (label.eval_fraction)
    reference_path: str = ""  # dpo: the frozen reference policy (a directory or a committed step URI)
    ppo_inputs: dict[str, Any] = field(default_factory=dict)  # ppo: PPOInputs fields (step URIs allowed)
    rollout_devices: str | None = None  # ppo: CUDA_VISIBLE_DEVICES of the rollout worker (placement.rollout)
    overrides: StageOverrides = field(default_factory=StageOverrides)  # ppo: an operator's, after a breach


def make_context(config: Config, call: StageCall, sink: Any, runtime: Runtime | None = None) -> StageContext:
    """The stage's context; `runtime` defaults to the configured backend's. Every rank gets the
    mirror (checkpoint.mirror) for resuming; only rank 0 ever starts its copying thread."""
    store = CheckpointStore(call.store_url, config.run.storage_options)
    return StageContext(
        store=store,
        stage=call.stage,
        round_index=call.round_index,
        seed=config.run.seed,
        identity=call.identity,
        identity_tree=call.identity_tree,
        every_steps=config.checkpoint.every_steps,
        keep_last=config.checkpoint.keep_last,
        consolidate_every=config.checkpoint.consolidate_every,
        sink=sink,
        runtime=runtime or make_runtime(config.engine),
        allow_config_change=config.resume.allow_config_change,
        limits=GuardLimits(
            hang_timeout_s=config.stage.policy(call.stage).hang_timeout_s,
            preempt_grace_s=config.checkpoint.preempt_grace_s,
            max_nonfinite_skips=config.safety.max_nonfinite_skips,
        ),
        mirror=make_mirror(store, config.checkpoint, config.run.name, call.round_index, call.stage),
    )


def run_stage_call(ctx: StageContext, config: Config, call: StageCall) -> StageOutcome:
    """Run a training stage; model inputs given as checkpoint step URIs are fetched to this
    machine's cache first (every node of a job resolves its own)."""
    wait_s = 0.0  # a failed stage leaves no copying thread behind (Prefect processes live long)
    try:
        outcome = _run_stage_call(ctx, config, call)
        wait_s = ctx.mirror.finish_wait_s if ctx.mirror is not None else 0.0  # e.g. paused for an operator
        return outcome
    except StagePreempted:
        wait_s = config.checkpoint.preempt_grace_s / 2  # the newest step is the one a lost machine needs copied
        raise
    finally:
        if ctx.mirror is not None:
            ctx.mirror.close(wait_s=wait_s)


def _run_stage_call(ctx: StageContext, config: Config, call: StageCall) -> StageOutcome:
    so = config.run.storage_options
    if call.stage == "sft":
        return run_sft_stage(ctx, model_location(call.init_path, so), config.model, config.sft, config.data)
    if call.stage == "rm":
        init = model_location(call.init_path, so)
        return run_reward_model_stage(
            ctx, init, config.model, config.rm, config.data, call.extra_preferences, call.eval_preferences
        )
    if call.stage == "dpo":
        init, reference = model_location(call.init_path, so), model_location(call.reference_path, so)
        dpo = config.dpo
        return run_dpo_stage(
            ctx, init, reference, config.model, dpo, config.data, call.extra_preferences, dpo.include_offline
        )
    if call.stage == "ppo":
        located = lambda k, v: v if k == "score_norm" or v is None else model_location(v, so)  # noqa: E731
        fields = {k: located(k, v) for k, v in call.ppo_inputs.items()}
        norm = call.ppo_inputs["score_norm"]
        inputs = PPOInputs(**{**fields, "score_norm": None if norm is None else tuple(norm)})
        gold = load_bound_function(config.gold, "gold.fn")
        return run_ppo_stage(
            ctx,
            inputs,
            config.model,
            config.ppo,
            config.eval,
            config.data,
            config.checkpoint,
            gold,
            config.rollout,
            call.rollout_devices,
            PPOGuards.of(config.safety, config.reward, call.overrides),
            Objective.of(config.algorithm, config.rollout.n),
            config.reward,
        )
    raise ValueError(f"unknown training stage {call.stage!r}; valid: {', '.join(TRAINING_STAGES)}")


def write_spec(
    url: str,
    public_config: dict[str, Any],
    call: StageCall,
    outcome_url: str,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The spec a worker reads, at any fsspec URL (a local file, or under run.root so that every
    node of a multi-node job can read it). Secrets are not in it."""
    spec = {"config": public_config, "call": dataclasses.asdict(call), "outcome_path": outcome_url}
    with fsspec.open(url, "w", **(storage_options or {})) as f:
        json.dump(spec, f)


def main(spec_url: str) -> None:
    secrets = json.loads(os.environ.get(SECRETS_ENV) or "{}")
    storage_options = (secrets.get("run") or {}).get("storage_options") or {}  # run.root's credentials
    with fsspec.open(spec_url, "r", **storage_options) as f:
        spec = json.load(f)
    config = build_config(merge_trees(spec["config"], secrets), spec_url)
    fields = spec["call"]
    pairs = {k: tuple(fields.get(k) or ()) for k in ("extra_preferences", "eval_preferences")}
    call = StageCall(**{**fields, **pairs, "overrides": StageOverrides(**fields.get("overrides") or {})})
    set_threads(int(os.environ.get("OMP_NUM_THREADS") or config.run.threads))
    main_rank = int(os.environ.get("RANK", "0")) == 0  # the process group does not exist yet
    ctx = make_context(config, call, EventSink() if main_rank else NullSink())
    outcome = run_stage_call(ctx, config, call)
    if dist.is_main():  # read by the task only after every rank exited cleanly
        with fsspec.open(spec["outcome_path"], "w", **storage_options) as f:
            json.dump(dataclasses.asdict(outcome), f)
    ctx.runtime.close()


if __name__ == "__main__":
    from rlflow.engine.launch import line_buffered_output, record_failures

    line_buffered_output()
    with record_failures():
        try:
            main(sys.argv[1])
        except StagePreempted as exc:  # a clean stop at a committed checkpoint, not a failure
            print(f"rlflow: {exc}", file=sys.stderr, flush=True)
            sys.exit(StagePreempted.exit_code)
        except NOT_RETRIED as exc:  # exit 2 tells the task (and Prefect's retries) that a rerun would fail too
            print(f"rlflow: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
