"""The RL stage: RL steps (engine/stages/rl/run.py) in the stage loop, with checkpoints, evaluations,
the KL stop, the guards (KL circuit breaker, reward-source failures: engine/stages/breaker.py) and
the reward-hacking detector's rollback."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from rlflow.engine.backend import dist
from rlflow.engine.errors import RewardSourceError
from rlflow.engine.promotion.hacking import DetectorLimits, candidate_step, detect_divergence, window_changes
from rlflow.engine.stages.breaker import RLGuards, RLSafety, paused_outcome
from rlflow.engine.stages.context import Breach, StageContext, StageOutcome
from rlflow.engine.stages.lifecycle import finish, restore_training_state, save_checkpoint
from rlflow.engine.stages.loop import StageStart, StepReport, run_stage_loop
from rlflow.engine.stages.rl.inputs import RLInputs
from rlflow.engine.stages.rl.run import RLRun
from rlflow.engine.stages.rl.tool_journal import ToolJournal

log = logging.getLogger(__name__)

ROLLOUT_BUFFER_FILE = "rollout_buffer.json"  # rollout.off_policy_steps > 0 or async: what was sampled ahead


@dataclass
class RLLoopState:
    """What the step loop carries across steps and resumes (JSON in the checkpoint's meta)."""

    best: float | None = None  # checkpoint.keep_best's metric at its best evaluated step
    best_step: int | None = None
    stopped_by_kl: bool = False  # kl.stop_above ended the round's RL
    hacking_history: list[list[float | None]] = field(default_factory=list)  # [step, proxy, judge, valid, spread]
    hacking_window_start: int | None = None  # the detector stopped the RL: the diverged window's first step


def run_rl_stage(ctx: StageContext, inputs: RLInputs, start: StageStart) -> StageOutcome:
    """Run rl.steps RL steps (fewer if rollout KL passes `kl.stop_above`), resuming if possible.
    algorithm.name picks the estimator (PPO, GRPO, RLOO, REINFORCE++), reward.sources the reward. A KL
    breach, or a reward failure under reward.on_failure=pause, returns an unfinished outcome with
    `breach` set (a committed checkpoint, no final.json) instead."""
    resume, changed, guard = start
    journal = None if inputs.env is None else ToolJournal(ctx.store, ctx.identity, dist.rank())
    restored: dict[str, Any] = {}

    def restore(run: RLRun) -> None:
        meta = restore_training_state(ctx, resume, run.engines)
        run.controller.load_state_dict(meta["kl_controller"])
        restored.update(state=RLLoopState(**meta["rl_state"]), guards=meta.get("guards"))

    run = RLRun.open(ctx.runtime, inputs, ctx.round_index, ctx.sink, journal, None if resume is None else restore)
    try:
        guards = RLGuards.of(inputs.kl, inputs.reward, ctx.overrides)
        safety = RLSafety(guards, ctx.label, restored.get("guards"), resume, run.controller, run.models.reward)
        if inputs.rollout.mode == "server":  # the worker takes the restored actor's weights
            run.start_rollout(resume or 0, _sampled_ahead(ctx, inputs, resume), _worker_log(ctx), ctx.rollout_devices)
        steps = RLSteps(ctx, run, RLStart(resume, changed, restored.get("state", RLLoopState()), safety))
        end = run_stage_loop(ctx, guard, steps, resume or 0)
        if end.paused is not None:
            return end.paused
        step = end.step
        if journal is not None:
            journal.clear()
    finally:
        run.close()
    if steps.state.hacking_window_start is not None:  # the detector stopped it: roll back
        candidate, summary = _hacking_candidate(ctx, steps.state, step)
        return finish(ctx, candidate, summary | steps.safety.summary(), resume, changed)
    if "eval/gold_score" not in steps.metrics:  # resumed exactly at the last step: evaluate its policy
        evaluation = run.evaluate()
        steps.metrics.update(evaluation.metrics)
        ctx.sink.log_table("eval_samples.json", evaluation.samples)
    summary = _summary(steps.metrics, step, steps.state) | steps.safety.summary() | guard.early_stop_metrics()
    return finish(ctx, step, summary, resume, changed)


def _sampled_ahead(ctx: StageContext, inputs: RLInputs, resume: int | None) -> dict[str, Any]:
    """What a resumed off-policy (or async) stage's worker had sampled ahead, kept in its checkpoint."""
    if resume is None or not inputs.rollout.samples_ahead or not dist.is_main():
        return {}
    return ctx.store.read_json(resume, ROLLOUT_BUFFER_FILE)


def _worker_log(ctx: StageContext) -> str:
    return os.path.join(tempfile.gettempdir(), f"rlflow-rollout-{ctx.identity[:12]}-rank{dist.rank()}.log")


@dataclass(frozen=True)
class RLStart:
    """Where this run of the stage starts: fresh (resume None) or at a resumed step, with the loop
    state restored from it and the guards (an operator's overrides applied)."""

    resume: int | None
    changed: tuple[str, ...]  # identity keys changed under resume.allow_config_change
    state: RLLoopState
    safety: RLSafety


class RLSteps:
    """The RL stage's part of the stage loop (engine/stages/loop.py): the run's steps, the loop
    state and guards; the KL stop, the breaker, the hacking detector and the evaluations."""

    def __init__(self, ctx: StageContext, run: RLRun, start: RLStart):
        self.ctx, self.run, inputs = ctx, run, run.inputs
        self.cfg, self.eval_cfg, self.kl, self.hacking = inputs.rl, inputs.eval, inputs.kl, inputs.hacking
        self.keep_best = inputs.checkpoint
        self.valid_source, self.judge_source = inputs.reward.valid, inputs.reward.judge
        self.resume, self.changed = start.resume, start.changed
        self.state, self.safety = start.state, start.safety
        self.committed = start.resume  # the newest step this stage holds: a pause commits its step only if needed
        self.metrics: dict[str, float] = {}

    @property
    def engines(self) -> tuple[Any, ...]:
        return tuple(self.run.engines.values())

    def more(self, step: int) -> bool:
        state = self.state
        return step < self.cfg.steps and not state.stopped_by_kl and state.hacking_window_start is None

    def watch_hacking(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Record this step's signals, return hacking/*; on a divergence mark the window it began."""
        h, state = self.hacking, self.state
        signal = lambda name: None if name is None else metrics.get(f"reward/{name}/mean")  # noqa: E731
        row = [step, metrics.get("critic/score/mean"), signal(self.judge_source), signal(self.valid_source)]
        state.hacking_history.append(row + [metrics.get("critic/score_std_ensemble")])
        limits = DetectorLimits(h.window, h.min_judge_drop, h.max_valid_drop, h.max_spread_ratio)
        divergence = detect_divergence(state.hacking_history, limits)
        out = window_changes(state.hacking_history, h.window) | {"hacking/diverged": float(divergence is not None)}
        if divergence is not None:
            state.hacking_window_start = divergence.window_start
            where = f"the candidate is the last checkpoint before step {divergence.window_start}"
            log.warning("%s: %s; %s", self.ctx.label, divergence.message, where)
        return out

    def update(self, step: int) -> dict[str, float] | Breach:
        """One RL step's rollout, scoring and updates. A reward failure is raised before any update,
        so the step can run again on the fallback rule (or pause: the Breach)."""
        try:
            return self.run.step(step)
        except RewardSourceError as exc:
            if (breach := self.safety.reward_failed(exc, step, self.metrics)) is not None:
                return breach
            return self.run.step(step)  # the same step again, scored by the fallback rule

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        """The KL stop and breaker, and the evaluation every eval.every_steps and at the end."""
        cfg, state = self.cfg, self.state
        stop = self.kl.stop_above
        state.stopped_by_kl = stop is not None and metrics["actor/kl"] > stop
        metrics["actor/stopped_by_kl"] = float(state.stopped_by_kl)
        if self.hacking is not None:
            metrics |= self.watch_hacking(step, metrics)
        breach = self.safety.observe(step, metrics, state.stopped_by_kl)
        last = step >= cfg.steps or state.stopped_by_kl or state.hacking_window_start is not None
        if breach is None and (step % self.eval_cfg.every_steps == 0 or last):
            evaluation = self.run.evaluate()
            metrics.update(evaluation.metrics)
            _track_best(state, self.keep_best.keep_best, self.keep_best.keep_best_mode, metrics, step)
            if last:
                self.ctx.sink.log_table("eval_samples.json", evaluation.samples)
        self.metrics = metrics
        logged = step % cfg.log_every == 0 or last
        return StepReport(metrics, last or stopping, logged, keep=state.best_step == step, breach=breach)

    def commit(self, at: int, whole: bool, last: bool = False, breach: Breach | None = None) -> str:
        guards = self.safety.state_dict(breach)
        recent: set[int] = set()
        if self.hacking is not None:  # a rollback target: whole, and kept while a later window can still diverge
            whole, reach = True, self.hacking.window + self.run.inputs.rollback_every_steps
            recent = {s for s in self.ctx.store.committed_steps() if s >= at - reach}
        url = _commit(self.ctx, self.run, self.state, guards, at, whole, recent)
        self.committed = at
        return url

    def pause(self, breach: Breach) -> StageOutcome:
        """Stop for an operator at committed step breach.step (committed now, whole, if it is not yet)."""
        at = breach.step
        if self.committed != at:
            self.commit(at, True, breach=breach)  # whole model directories: the operator may want to look at it
        log.warning("%s: %s", self.ctx.label, breach.message)
        summary = _summary(self.metrics, at, self.state) | self.safety.summary()
        return paused_outcome(self.ctx, breach, summary, self.resume, self.changed)


def _commit(
    ctx: StageContext,
    run: RLRun,
    state: RLLoopState,
    guards: dict[str, Any],
    step: int,
    whole: bool,
    protect: set[int] = frozenset(),
) -> str:
    """Commit an RL step: actor and critic, KL controller, loop state and the guards' state;
    `protect`: older steps pruning must keep (besides keep_best's)."""
    models = run.models
    engines = {"model": (models.actor, models.tokenizer)}
    if models.critic is not None:
        engines["critic"] = (models.critic, None)
    files = {}
    if models.rollout is not None and models.rollout.cfg.samples_ahead:  # what was sampled ahead
        files[ROLLOUT_BUFFER_FILE] = models.rollout.state_dict()
    meta = {
        "kl_controller": run.controller.state_dict(),
        "rl_state": dataclasses.asdict(state),
        "guards": guards,
        "data_position": {"prompts_seen": step * run.inputs.rl.rollout_batch},
    }
    keep = ({state.best_step} if state.best_step else set()) | set(protect)
    return save_checkpoint(ctx, step, engines, meta, whole, protect=keep, files=files)


def _hacking_candidate(ctx: StageContext, state: RLLoopState, step: int) -> tuple[int, dict[str, float]]:
    """The stage's output after a divergence: checkpoint.keep_best's best step (e.g. on the judge)
    when it precedes the diverged window, else the last committed step before it, or, when none
    precedes it, the step the detector stopped at (the promotion gates judge it)."""
    window_start = state.hacking_window_start
    candidate = candidate_step(ctx.store.committed_steps(), window_start)
    if state.best_step is not None and state.best_step < window_start:  # kept whole and unpruned
        candidate = state.best_step
    if candidate is None:
        log.warning("%s: no checkpoint precedes the diverged window (steps %d-%d); the candidate is step %d",
                    ctx.label, window_start, step, step)
        candidate = step
    summary = {"rl/steps": candidate, "rl/stopped_by_kl": float(state.stopped_by_kl), "hacking/diverged": 1.0}
    return candidate, summary | {"hacking/stopped_at": step, "hacking/window_start": window_start}


def _summary(metrics: dict[str, float], step: int, state: RLLoopState) -> dict[str, float]:
    keep = ("critic/score/mean", "actor/kl", "eval/gold_score", "eval/rm_score", "eval/kl", "response_length/mean")
    return {k: metrics[k] for k in keep if k in metrics} | {
        "rl/steps": step,
        "rl/stopped_by_kl": float(state.stopped_by_kl),
    }


def _track_best(state: RLLoopState, metric: str | None, mode: str, metrics: dict[str, float], step: int) -> None:
    if not metric or metric not in metrics:
        return
    sign = 1.0 if mode == "max" else -1.0
    if state.best is None or sign * metrics[metric] > sign * state.best:
        state.best, state.best_step = metrics[metric], step
