"""The one step loop every training stage runs (SFT, reward model, DPO, the RL stage).

It owns the lifecycle and the guard protocol, in this order each step: the guard's `begin` (the
heartbeat and the step/sigterm/hang fault points), the non-finite-loss fault, the stage's update,
the skipped-update count, the `update` fault point, the stage's evaluation, the guard's `end`,
logging, and the checkpoint cadence (scheduled, last step, preemption, or a step the stage asks to
keep). A stage supplies only its update, what follows it, and its commit: `StageSteps`.
A training stage's body gets its StageStart from the one dispatcher (engine/stages/catalog.py
run_stage): the resumed step (or none), what changed, and the stage's guard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from rlflow.engine.backend.runtime import TrainEngine
from rlflow.engine.faults import fault_point
from rlflow.engine.stages.context import Breach, StageContext, StageOutcome
from rlflow.engine.stages.guard import StageGuard
from rlflow.engine.stages.lifecycle import should_consolidate


class StageStart(NamedTuple):
    """Where a training stage begins (unpack it: `resume, changed, guard = start`)."""

    resume: int | None  # the committed step it resumes from; None: a fresh start
    changed: tuple[str, ...]  # identity keys changed under resume.allow_config_change
    guard: StageGuard


@dataclass
class StepReport:
    """What a stage says about a step after its update."""

    metrics: dict[str, float]  # logged if `log`; timing_s/elapsed is added by the loop
    last: bool  # the stage's own end after this step (max steps, plateau, KL stop, a stop request)
    log: bool  # log this step's metrics
    keep: bool = False  # commit this step, whole, even off the cadence (the RL stage's best step)
    breach: Breach | None = None  # stop for an operator at breach.step (the RL stage's guards)


class StageSteps(Protocol):
    """What a training stage supplies to `run_stage_loop`."""

    engines: tuple[TrainEngine, ...]  # the models trained: each step's non-finite fault poisons them

    def more(self, step: int) -> bool:
        """Is another step due after `step` completed steps (a stop request aside)?"""

    def update(self, step: int) -> dict[str, float] | Breach:
        """One optimizer step: its metrics, with "skipped" (1.0: a non-finite update was skipped);
        or a Breach when the stage must stop for an operator before updating."""

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        """After the update: evaluation and bookkeeping. `stopping`: a stop request makes this the last step."""

    def commit(self, step: int, whole: bool, last: bool) -> str:
        """Save a checkpoint of `step` (whole: consolidated model directories); returns its URL."""

    def pause(self, breach: Breach) -> StageOutcome:
        """Stop for an operator (only stages whose update or report can return a Breach need it)."""


@dataclass(frozen=True)
class LoopEnd:
    step: int  # the last completed step
    paused: StageOutcome | None  # the stage stopped for an operator: its unfinished outcome


def run_stage_loop(ctx: StageContext, guard: StageGuard, stage: StageSteps, step: int) -> LoopEnd:
    """Run `stage`'s steps from completed step `step` until it ends, a stop request, a preemption
    (StagePreempted after the commit) or a breach (the stage's pause, inside the guard)."""
    started = time.monotonic()
    with guard:
        while stage.more(step) and not guard.stop_requested:
            step += 1
            guard.begin(step)
            for engine in stage.engines:
                engine.poison_loss = guard.poisoned(step)
            metrics = stage.update(step)
            if isinstance(metrics, Breach):
                guard.suspend()  # pausing commits a whole checkpoint
                return LoopEnd(step, stage.pause(metrics))
            metrics |= guard.record_update(bool(metrics.pop("skipped")), step)
            fault_point(ctx.stage, "update", step)
            report = stage.report(step, metrics, guard.stop_requested)
            report.metrics["timing_s/elapsed"] = time.monotonic() - started
            guard.end(step)
            if report.log or report.breach is not None:
                ctx.sink.log_metrics(report.metrics, step)
            if report.breach is not None:
                guard.suspend()
                return LoopEnd(step, stage.pause(report.breach))
            last = report.last or guard.stop_requested  # a callback may have asked to stop while logging
            if guard.checkpoint_due(step, last) or report.keep:
                whole = should_consolidate(ctx, step, last) or report.keep
                guard.after_checkpoint(step, stage.commit(step, whole, last))
    return LoopEnd(step, None)
