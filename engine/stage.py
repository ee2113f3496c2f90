"""What every stage shares: its context, its outcome record, and the resume/commit protocol.

A stage's identity (config subtree + input manifests + data fingerprints) is checked against the
store's `final` marker: the marker, not Prefect's cache, is the truth about completion.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from rlflow.engine import dist
from rlflow.engine.backend import Runtime, TrainEngine
from rlflow.engine.checkpoint import CheckpointStore
from rlflow.engine.config import diff_keys
from rlflow.engine.errors import CheckpointError
from rlflow.engine.metrics import MetricsSink, NullSink
from rlflow.engine.models import save_model_dir
from rlflow.engine.optim_state import STATE_FILE, ShardReader, owned, restore_rng, shard_bytes, shard_name, state_json

FAULT_ENV = "RLFLOW_FAULT"  # "<stage>:<event>:<step>": die (os._exit) at that point, for kill tests


@dataclass(frozen=True)
class StageContext:
    """Where a stage writes and how it is identified; no whole-config object travels here."""

    store: CheckpointStore
    stage: str  # "sft" | "rm" | "ppo" | "eval" | "label"
    round_index: int
    seed: int
    identity: str  # sha256 over config subtree, input manifests and data fingerprints
    identity_tree: dict[str, Any]  # what the identity was computed from (for "what changed")
    every_steps: int = 10
    keep_last: int = 2
    consolidate_every: int = 1  # checkpoints between whole HF model directories (the last is always whole)
    sink: MetricsSink = field(default_factory=NullSink)
    runtime: Runtime = field(default_factory=Runtime)  # torch in this process, or this rank's DeepSpeed

    @property
    def label(self) -> str:
        return f"round {self.round_index} {self.stage}"


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    round_index: int
    step: int
    checkpoint_uri: str  # URL of the committed step holding the stage's output
    manifest_sha256: str  # identity of that output for the next stage's cache key
    metrics: dict[str, float]
    resumed_from: int | None = None
    skipped: bool = False  # True when the final marker already matched (nothing was run)


def compute_identity(tree: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()


def completed_outcome(ctx: StageContext) -> StageOutcome | None:
    """The recorded outcome if this stage already finished with the same identity.

    A finished stage with a different identity is an error saying what changed: re-running it
    would silently replace an output later stages were trained from.
    """
    final = ctx.store.final()
    if final is None:
        return None
    if final.get("identity") != ctx.identity:
        # "config.ppo.clip_ratio" -> "ppo.clip_ratio"; "inputs.policy" and "data.sft" stay as they are.
        changed = [k.removeprefix("config.") for k in diff_keys(final.get("identity_tree", {}), ctx.identity_tree)] or [
            "(inputs)"
        ]
        raise CheckpointError(
            f"stage round_{ctx.round_index}/{ctx.stage} at {ctx.store.url} already finished with a different "
            f"configuration or inputs (changed: {', '.join(changed[:8])}); use a new run.name to run it again"
        )
    return StageOutcome(
        stage=ctx.stage,
        round_index=ctx.round_index,
        step=final["step"],
        checkpoint_uri=ctx.store.step_url(final["step"]),
        manifest_sha256=final["manifest_sha256"],
        metrics=final.get("metrics", {}),
        skipped=True,
    )


def fault_point(stage: str, event: str, step: int) -> None:
    """Die like a SIGKILL (no cleanup) when RLFLOW_FAULT names this point; used by kill tests."""
    if os.environ.get(FAULT_ENV) == f"{stage}:{event}:{step}":
        os._exit(137)


def save_checkpoint(
    ctx: StageContext,
    step: int,
    engines: dict[str, tuple[TrainEngine, Any]],
    meta: dict[str, Any],
    consolidate: bool,
    protect: set[int] | frozenset[int] = frozenset(),
) -> str:
    """Commit one step from all ranks (a collective: every rank calls it).

    Each rank writes its optimizer shard of every engine; with `consolidate`, rank 0 also writes
    each model as an HF directory (safetensors) under its prefix; then rank 0 writes the training
    state and the manifest, the commit point. `engines`: prefix -> (engine, tokenizer or None).
    """
    rank, world = dist.rank(), dist.world_size()
    with ctx.store.writer(step) if dist.is_main() else contextlib.nullcontext() as writer:
        dist.barrier()  # rank 0 has cleared any debris of this step before others write into it
        records, engines_meta = {}, {}
        for prefix, (engine, tokenizer) in engines.items():
            names = engine.param_names()
            mine = {}
            for index, name in enumerate(names):
                state = engine.full_param_state(name)  # a collective under ZeRO-3: every rank, every name
                if owned(index, rank, world):
                    mine[name] = state
            shard = shard_name(prefix, rank)
            records[shard] = ctx.store.put_shard(step, shard, shard_bytes(mine))
            state_dict = engine.gathered_state_dict() if consolidate else None
            if writer is not None and consolidate:
                save_model_dir(engine.model, tokenizer, writer, prefix, state_dict)
            engines_meta[prefix] = {
                "adam_step": engine.adam_step(),
                "world_size": world,
                "schedule": engine.schedule.state_dict(),
            }
        every_rank = dist.all_gather_json(records)
        if writer is not None:
            for rank_records in every_rank:
                for name, record in rank_records.items():
                    writer.adopt(name, record)
            fault_point(ctx.stage, "mid_checkpoint", step)
            writer.write_bytes(STATE_FILE, state_json(engines_meta))
            writer.meta.update(meta, identity=ctx.identity, consolidated=consolidate)
    dist.barrier()
    if dist.is_main():
        fault_point(ctx.stage, "after_checkpoint", step)
        # The step just written always survives: steps left by an abandoned run with another
        # identity must not push it out of keep_last.
        ctx.store.prune(ctx.keep_last, protect=set(protect) | {step})
    dist.barrier()
    return ctx.store.step_url(step)


def should_consolidate(ctx: StageContext, step: int, last: bool) -> bool:
    """Whole HF model directories at the stage's end and every `consolidate_every`-th checkpoint."""
    return last or (step // ctx.every_steps) % ctx.consolidate_every == 0


def latest_resumable(ctx: StageContext) -> int | None:
    """Latest committed step of this stage's identity (steps from another identity are ignored)."""
    for step in reversed(ctx.store.committed_steps()):
        if ctx.store.manifest(step)["meta"].get("identity") == ctx.identity:
            return step
    return None


def restore_training_state(ctx: StageContext, step: int, engines: dict[str, TrainEngine]) -> dict[str, Any]:
    """Load weights, Adam state and schedule of every engine from `step`, whatever world size wrote
    it; restore the RNG; return the step's manifest meta. A collective under ZeRO-3."""
    local = ctx.store.local_dir(step)
    with open(os.path.join(local, STATE_FILE), "rb") as f:
        state = json.loads(f.read())
    for prefix, engine in engines.items():
        saved = state["engines"].get(prefix)
        if saved is None:
            raise CheckpointError(f"{ctx.store.step_url(step)} has no optimizer state for {prefix!r}")
        reader = ShardReader(local, prefix, saved["world_size"])
        missing = sorted(set(engine.param_names()) - reader.names())
        if missing:
            raise CheckpointError(
                f"{ctx.store.step_url(step)}: optimizer shards of {prefix!r} lack parameters {missing[:3]}; "
                "the model architecture changed since this checkpoint"
            )
        engine.set_adam_step(saved["adam_step"])
        for name in engine.param_names():
            engine.load_param_state(name, reader.get(name))
        engine.schedule.load_state_dict(saved["schedule"])
        for group, lr in zip(engine.schedule.optimizer.param_groups, engine.schedule.get_last_lr()):
            group["lr"] = lr  # a scheduler's load_state_dict does not touch the optimizer
    restore_rng(state["rng"])
    return ctx.store.manifest(step)["meta"]


def finish(ctx: StageContext, step: int, metrics: dict[str, float], resumed_from: int | None) -> StageOutcome:
    metrics = {k: float(v) for k, v in metrics.items()}
    if not dist.is_main():  # rank 0 records the outcome; the others only report what it will say
        return StageOutcome(ctx.stage, ctx.round_index, step, ctx.store.step_url(step), "", metrics, resumed_from)
    record = ctx.store.mark_final(
        step, {"identity": ctx.identity, "identity_tree": ctx.identity_tree, "metrics": metrics}
    )
    ctx.sink.log_text("checkpoint_uri.txt", ctx.store.step_url(step) + "\n")
    return StageOutcome(
        stage=ctx.stage,
        round_index=ctx.round_index,
        step=step,
        checkpoint_uri=ctx.store.step_url(step),
        manifest_sha256=record["manifest_sha256"],
        metrics=metrics,
        resumed_from=resumed_from,
    )


def set_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
