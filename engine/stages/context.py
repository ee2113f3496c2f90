"""The records every stage shares: its context (store, runtime, sinks, guard limits) and its
outcome, including the breach that paused it.

The outcome and the breach cross process boundaries (a DeepSpeed rank's outcome file, a Prefect
task's persisted result, the pause form), so they are pydantic models: one typed JSON round trip,
no hand-written conversions. The context stays in its process.

A stage's identity (config subtree + input manifests + data fingerprints) is checked against the
store's `final` marker: the marker, not Prefect's cache, is the truth about completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.storage.mirror import CheckpointMirror, MirrorLagSink
from rlflow.engine.telemetry.metrics import MetricsSink, NullSink
from rlflow.engine.telemetry.progress import StopRequest


@dataclass(frozen=True)
class GuardLimits:
    hang_timeout_s: float | None = None  # None: no watchdog
    preempt_grace_s: float = 120.0
    max_nonfinite_skips: int = 3


class Record(BaseModel):
    """A frozen record that survives JSON: NaN and infinite metrics are written as such, not null."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


@dataclass(frozen=True)
class StageOverrides:
    """An operator's changes for continuing a paused RL stage (flows/breach.py). Not part of the stage
    identity: the continued stage is the same stage and resumes from its checkpoint."""

    max_kl: float | None = None  # replaces kl.pause_above for the rest of the stage, kept on resume
    kl_coef: float | None = None  # the KL controller's value from the continued step on
    # The step the continuation resumes from. kl_coef applies only when resuming at or before it:
    # a retry that resumes from a later checkpoint keeps the controller value that checkpoint holds.
    from_step: int | None = None


class Breach(Record):
    """Why and where a stage stopped for an operator."""

    reason: str  # BREACH_KL | BREACH_REWARD
    step: int  # the committed step the stage stopped at: continuing resumes from it
    metrics: dict[str, float]  # actor/kl, safety/max_kl, ... at the breach
    message: str  # one line for logs, alerts and the pause form


@dataclass(frozen=True)
class StageContext:
    """Where a stage writes and how it is identified; no whole-config object travels here."""

    store: CheckpointStore
    stage: str  # "sft" | "label" | "rm" | "rl" | "dpo" | "eval"
    round_index: int
    seed: int
    identity: str  # sha256 over config subtree, input manifests and data fingerprints
    identity_tree: dict[str, Any]  # what the identity was computed from (for "what changed")
    every_steps: int = 10
    keep_last: int = 2
    consolidate_every: int = 1  # checkpoints between whole HF model directories (the last is always whole)
    sink: MetricsSink = field(default_factory=NullSink)
    runtime: Runtime = field(default_factory=Runtime)  # torch in this process, or this rank's DeepSpeed
    limits: GuardLimits = field(default_factory=GuardLimits)  # watchdog, preemption, non-finite skips
    allow_config_change: bool = False  # resume.allow_config_change: continue a stage whose identity changed
    mirror: CheckpointMirror | None = None  # checkpoint.mirror: a second copy of every committed step
    stop: StopRequest | None = None  # a callback's early stop (in-process stages only)
    overrides: StageOverrides = field(default_factory=StageOverrides)  # an operator's, continuing after a breach
    rollout_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the RL stage's rollout replica (placement.rollout)

    def __post_init__(self) -> None:
        # Every logged step reports checkpoint/mirror_lag_steps without the stage loops knowing.
        if self.mirror is not None and not isinstance(self.sink, MirrorLagSink):
            object.__setattr__(self, "sink", MirrorLagSink(self.sink, self.mirror))

    @property
    def label(self) -> str:
        return f"round {self.round_index} {self.stage}"


class StageOutcome(Record):
    stage: str
    round_index: int
    step: int
    checkpoint_uri: str  # URL of the committed step holding the stage's output
    manifest_sha256: str  # identity of that output for the next stage's cache key
    metrics: dict[str, float]
    resumed_from: int | None = None
    skipped: bool = False  # True when the final marker already matched (nothing was run)
    changed_keys: tuple[str, ...] = ()  # identity keys changed under resume.allow_config_change
    # the RL stage stopped for an operator (engine/stages/breaker.py): not finished, no final.json
    breach: Breach | None = None
