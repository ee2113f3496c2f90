"""What every stage shares: its context, its outcome record, and the resume/commit protocol.

A stage's identity (config subtree + input manifests + data fingerprints) is checked against the
store's `final` marker: the marker, not Prefect's cache, is the truth about completion.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from rlflow.engine.checkpoint import CheckpointStore
from rlflow.engine.config import diff_keys
from rlflow.engine.errors import CheckpointError
from rlflow.engine.metrics import MetricsSink, NullSink
from rlflow.engine.models import model_dir, save_model_dir
from rlflow.engine.train_state import load_training_state, save_training_state

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
    sink: MetricsSink = field(default_factory=NullSink)

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
    models: dict[str, tuple[Any, Any]],
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    meta: dict[str, Any],
    protect: set[int] | frozenset[int] = frozenset(),
) -> str:
    """Commit one step: HF model dirs, training state, then the manifest (the commit point)."""
    with ctx.store.writer(step) as writer:
        for prefix, (model, tokenizer) in models.items():
            save_model_dir(model, tokenizer, writer, prefix)
        fault_point(ctx.stage, "mid_checkpoint", step)
        save_training_state(writer, optimizers, schedulers)
        writer.meta.update(meta, identity=ctx.identity)
    fault_point(ctx.stage, "after_checkpoint", step)
    # The step just written always survives: steps left by an abandoned run with another
    # identity must not push it out of keep_last.
    ctx.store.prune(ctx.keep_last, protect=set(protect) | {step})
    return ctx.store.step_url(step)


def latest_resumable(ctx: StageContext) -> int | None:
    """Latest committed step of this stage's identity (steps from another identity are ignored)."""
    for step in reversed(ctx.store.committed_steps()):
        if ctx.store.manifest(step)["meta"].get("identity") == ctx.identity:
            return step
    return None


def resume_point(ctx: StageContext, init_path: str) -> tuple[int | None, str]:
    """(latest resumable step or None, the model directory to load: that step's or init_path)."""
    step = latest_resumable(ctx)
    return step, (model_dir(ctx.store.local_dir(step)) if step is not None else init_path)


def restore_training_state(
    ctx: StageContext, step: int, optimizers: dict[str, Any], schedulers: dict[str, Any]
) -> dict[str, Any]:
    load_training_state(ctx.store.read_bytes(step, "training_state.pt"), optimizers, schedulers)
    return ctx.store.manifest(step)["meta"]


def finish(ctx: StageContext, step: int, metrics: dict[str, float], resumed_from: int | None) -> StageOutcome:
    metrics = {k: float(v) for k, v in metrics.items()}
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
