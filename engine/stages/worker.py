"""Run one training stage: in this process (torch backend) or as every rank of a distributed job.

`python -m rlflow.engine.stages.worker SPEC.json` is what the launcher starts on each rank. The spec
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
from typing import Any

import fsspec

from rlflow.engine.backend import dist
from rlflow.engine.backend.deepspeed_import import preload_deepspeed
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.backend.factory import make_runtime
from rlflow.engine.stages.breaker import PPOGuards, StageOverrides
from rlflow.engine.storage.checkpoint import CheckpointStore, model_location
from rlflow.engine.config.schema import Config, build_config
from rlflow.engine.stages.dpo import DPOStageInputs, run_dpo_stage
from rlflow.engine.config.secrets import merge_trees
from rlflow.engine.telemetry.metrics import EventSink, NullSink
from rlflow.engine.storage.mirror import make_mirror
from rlflow.engine.stages.rl.experience import Objective
from rlflow.engine.stages.rl.stage import PPOInputs, RLStageInputs, run_ppo_stage
from rlflow.engine.stages.reward_model import RewardModelStageInputs, run_reward_model_stage
from rlflow.engine.rewards.user_functions import load_bound_function
from rlflow.engine.stages.sft import SFTStageInputs, run_sft_stage
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.lifecycle import set_threads
from rlflow.engine.errors import NonFiniteUpdates, RewardSourceError, RlflowError, StagePreempted
from rlflow.engine.stages.context import GuardLimits
from rlflow.engine.config.secrets import SECRETS_ENV

# Errors a rerun would meet again (bad input, deterministic divergence): never retried.
NOT_RETRIED = (RlflowError, NonFiniteUpdates, RewardSourceError)
TRAINING_STAGES = ("sft", "rm", "ppo", "dpo")


class StageCall(Record):
    """One training stage to run: what the task hands the stage, in this process or through the
    spec file every rank of a distributed job reads (one typed JSON round trip)."""

    stage: str  # one of TRAINING_STAGES
    store_url: str  # the stage's checkpoint prefix
    round_index: int
    identity: str
    identity_tree: dict[str, Any]
    init_path: str = ""  # sft, rm, dpo: the model to start from (a directory or a committed step URI)
    extra_preferences: tuple[str, ...] = ()  # rm, dpo: online-labelled pairs
    eval_preferences: tuple[str, ...] = ()  # rm: held-out online-labelled pairs (label.eval_fraction)
    reference_path: str = ""  # dpo: the frozen reference policy (a directory or a committed step URI)
    ppo_inputs: PPOInputs | None = None  # ppo: the models it starts from (committed step URIs allowed)
    rollout_devices: str | None = None  # ppo: CUDA_VISIBLE_DEVICES of the rollout worker (placement.rollout)
    overrides: StageOverrides = StageOverrides()  # ppo: an operator's, after a breach


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
    if call.stage == "sft":
        return run_sft_stage(ctx, _sft_inputs(config, call))
    if call.stage == "rm":
        return run_reward_model_stage(ctx, _reward_model_inputs(config, call))
    if call.stage == "dpo":
        return run_dpo_stage(ctx, _dpo_inputs(config, call))
    if call.stage == "ppo":
        return run_ppo_stage(ctx, _rl_inputs(config, call))
    raise ValueError(f"unknown training stage {call.stage!r}; valid: {', '.join(TRAINING_STAGES)}")


def _sft_inputs(config: Config, call: StageCall) -> SFTStageInputs:
    init = model_location(call.init_path, config.run.storage_options)
    return SFTStageInputs(init_path=init, model=config.model, sft=config.sft, data=config.data)


def _reward_model_inputs(config: Config, call: StageCall) -> RewardModelStageInputs:
    init = model_location(call.init_path, config.run.storage_options)
    return RewardModelStageInputs(
        init_path=init,
        model=config.model,
        rm=config.rm,
        data=config.data,
        extra_preferences=call.extra_preferences,
        eval_preferences=call.eval_preferences,
    )


def _dpo_inputs(config: Config, call: StageCall) -> DPOStageInputs:
    so = config.run.storage_options
    init, reference = model_location(call.init_path, so), model_location(call.reference_path, so)
    return DPOStageInputs(
        init_path=init,
        reference_path=reference,
        model=config.model,
        dpo=config.dpo,
        data=config.data,
        preference_files=call.extra_preferences,
        include_offline=config.dpo.include_offline,
    )


def _rl_inputs(config: Config, call: StageCall) -> RLStageInputs:
    so, given = config.run.storage_options, call.ppo_inputs
    models = ("policy", "reference", "sft", "reward_model", "critic")
    located = {k: model_location(getattr(given, k), so) for k in models if getattr(given, k) is not None}
    paths = dataclasses.replace(given, **located)
    gold = load_bound_function(config.gold, "gold.fn")
    return RLStageInputs(
        paths=paths,
        model=config.model,
        ppo=config.ppo,
        kl=config.kl,
        sampling=config.sampling,
        eval=config.eval,
        data=config.data,
        checkpoint=config.checkpoint,
        gold=gold,
        rollout=config.rollout,
        rollout_devices=call.rollout_devices,
        guards=PPOGuards.of(config.kl, config.reward, call.overrides),
        objective=Objective.of(config),
        reward=config.reward,
        env=config.env,
        hacking=config.hacking,
    )


def write_spec(
    url: str,
    public_config: dict[str, Any],
    call: StageCall,
    outcome_url: str,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The spec a worker reads, at any fsspec URL (a local file, or under run.root so that every
    node of a multi-node job can read it). Secrets are not in it."""
    spec = {"config": public_config, "call": call.model_dump(mode="json"), "outcome_path": outcome_url}
    with fsspec.open(url, "w", **(storage_options or {})) as f:
        json.dump(spec, f)


def main(spec_url: str) -> None:
    secrets = json.loads(os.environ.get(SECRETS_ENV) or "{}")
    storage_options = (secrets.get("run") or {}).get("storage_options") or {}  # run.root's credentials
    with fsspec.open(spec_url, "r", **storage_options) as f:
        spec = json.load(f)
    config = build_config(merge_trees(spec["config"], secrets), spec_url)
    call = StageCall.model_validate(spec["call"])
    set_threads(config.run.threads)
    preload_deepspeed()
    main_rank = int(os.environ.get("RANK", "0")) == 0  # the process group does not exist yet
    ctx = make_context(config, call, EventSink() if main_rank else NullSink())
    outcome = run_stage_call(ctx, config, call)
    if dist.is_main():  # read by the task only after every rank exited cleanly
        with fsspec.open(spec["outcome_path"], "w", **storage_options) as f:
            f.write(outcome.model_dump_json())
    ctx.runtime.close()


if __name__ == "__main__":
    from rlflow.engine.backend.supervise import record_failures
    from rlflow.engine.backend.supervise import line_buffered_output

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
