"""Run one stage: in this process, or as every rank of a distributed job (a training stage under
engine.backend=deepspeed).

`python -m rlflow.engine.stages.worker SPEC.json` is what the launcher starts on each rank. The spec
holds the config with secrets redacted (their values come from $RLFLOW_SECRETS), the stage's
identity and its upstream; every rank builds the stage's inputs with the stage's own `inputs_from`
(engine/stages/catalog.py), the builder the flow computed the identity from, and runs it with the
catalog's `run_stage`, as the in-process path does. Rank 0 reports metrics as event lines on stdout
and writes the outcome to the spec's `outcome_path`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import fsspec

from rlflow.engine.backend import dist
from rlflow.engine.backend.deepspeed_import import preload_deepspeed
from rlflow.engine.backend.factory import make_runtime
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.config.schema import Config, build_config
from rlflow.engine.config.secrets import SECRETS_ENV, merge_trees
from rlflow.engine.errors import NonFiniteUpdates, RewardSourceError, RlflowError, StagePreempted
from rlflow.engine.stages.catalog import run_stage, stage_inputs, stage_kind
from rlflow.engine.stages.context import GuardLimits, Record, StageContext, StageOverrides
from rlflow.engine.stages.inputs import StageInputs, located
from rlflow.engine.stages.lifecycle import set_threads
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.storage.mirror import make_mirror
from rlflow.engine.telemetry.metrics import EventSink, MetricsSink, NullSink
from rlflow.engine.telemetry.progress import StopRequest

# Errors a rerun would meet again (bad input, deterministic divergence): never retried.
NOT_RETRIED = (RlflowError, NonFiniteUpdates, RewardSourceError)


class StageCall(Record):
    """One stage to run: what the task hands the stage, in this process or through the spec file
    every rank of a distributed job reads (one typed JSON round trip)."""

    stage: str  # a key of engine/stages/catalog.py STAGES
    store_url: str  # the stage's checkpoint prefix
    round_index: int
    identity: str
    identity_tree: dict[str, Any]
    upstream: dict[str, Any]  # the stage's upstream record (catalog STAGES[stage].upstream) as JSON
    rollout_devices: str | None = None  # rl: CUDA_VISIBLE_DEVICES of the rollout worker (placement.rollout)
    overrides: StageOverrides = StageOverrides()  # rl: an operator's, after a breach


def make_context(
    config: Config, call: StageCall, sink: MetricsSink, runtime: Runtime | None = None, stop: StopRequest | None = None
) -> StageContext:
    """How the stage runs, as opposed to what it computes (its inputs): where it writes, its runtime
    (`runtime` defaults to the configured backend's for a training stage, plain torch otherwise),
    its checkpoint cadence and guard limits. Every rank gets the mirror (checkpoint.mirror) for
    resuming; only rank 0 ever starts its copying thread."""
    store = CheckpointStore(call.store_url, config.run.storage_options)
    if runtime is None:
        runtime = make_runtime(config.engine) if stage_kind(call.stage).trains else Runtime(config.engine)
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
        runtime=runtime,
        allow_config_change=config.resume.allow_config_change,
        limits=GuardLimits(
            hang_timeout_s=config.stage.policy(call.stage).hang_timeout_s,
            preempt_grace_s=config.checkpoint.preempt_grace_s,
            max_nonfinite_skips=config.safety.max_nonfinite_skips,
        ),
        mirror=make_mirror(store, config.checkpoint, config.run.name, call.round_index, call.stage),
        stop=stop,
        overrides=call.overrides,
        rollout_devices=call.rollout_devices,
    )


def call_inputs(config: Config, call: StageCall) -> StageInputs:
    """The stage's inputs, from its own builder; upstream models given as checkpoint step URIs are
    fetched to this machine's cache first (every node of a job resolves its own)."""
    return located(stage_inputs(config, call.stage, call.upstream), config.run.storage_options)


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
    outcome = run_stage(ctx, call_inputs(config, call))
    if dist.is_main():  # read by the task only after every rank exited cleanly
        with fsspec.open(spec["outcome_path"], "w", **storage_options) as f:
            f.write(outcome.model_dump_json())
    ctx.runtime.close()


if __name__ == "__main__":
    from rlflow.engine.backend.supervise import line_buffered_output, record_failures

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
