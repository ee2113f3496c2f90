"""Every stage, declared once: its upstream record, the builder of its inputs from the config and
that upstream, its body, and whether it trains (may run as a distributed job). The flow computes a
stage's identity from `inputs_from`'s record, and `run_stage` runs the body on the record the same
builder makes, so the two cannot drift apart. `run_stage` is the one way any stage is run: by its
Prefect task, by every rank of a distributed job (engine/stages/worker.py), by tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlflow.engine.config.schema import Config
from rlflow.engine.errors import StagePreempted
from rlflow.engine.stages import dpo, label, reward_model, round_eval, sft
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.guard import StageGuard
from rlflow.engine.stages.inputs import StageInputs
from rlflow.engine.stages.lifecycle import completed_outcome, start_stage
from rlflow.engine.stages.loop import StageStart
from rlflow.engine.stages.rl import inputs as rl_inputs
from rlflow.engine.stages.rl.stage import run_rl_stage


@dataclass(frozen=True)
class StageKind:
    upstream: type[Record]  # what the flow wires in: the models and labels other stages made
    inputs_from: Callable[[Config, Any], StageInputs]  # (config, upstream) -> everything the stage reads
    run: Callable[..., StageOutcome]  # (context, inputs[, start: a training stage's StageStart]) -> its outcome
    trains: bool  # a training stage: resumable step by step, every rank of a DeepSpeed job under deepspeed


STAGES = {
    "sft": StageKind(sft.SFTUpstream, sft.inputs_from, sft.run_sft_stage, trains=True),
    "label": StageKind(label.LabelUpstream, label.inputs_from, label.run_label_stage, trains=False),
    "rm": StageKind(
        reward_model.RewardModelUpstream, reward_model.inputs_from, reward_model.run_reward_model_stage, trains=True
    ),
    "rl": StageKind(rl_inputs.RLUpstream, rl_inputs.inputs_from, run_rl_stage, trains=True),
    "dpo": StageKind(dpo.DPOUpstream, dpo.inputs_from, dpo.run_dpo_stage, trains=True),
    "eval": StageKind(round_eval.EvalUpstream, round_eval.inputs_from, round_eval.run_eval_stage, trains=False),
}


def stage_kind(name: str) -> StageKind:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}")
    return STAGES[name]


def run_stage(ctx: StageContext, inputs: StageInputs) -> StageOutcome:
    """Run stage `ctx.stage` on its inputs: the outcome its store recorded if it already finished
    with this identity; else a training stage resumes from its last committed step (or starts),
    under its guard. The mirror (checkpoint.mirror) is given time to catch up, and stopped, whatever
    happens: a failed stage leaves no copying thread behind (Prefect processes live long)."""
    kind, wait_s = stage_kind(ctx.stage), 0.0
    try:
        if (done := completed_outcome(ctx)) is not None:
            return done
        if kind.trains:
            resume, changed = start_stage(ctx)
            outcome = kind.run(ctx, inputs, StageStart(resume, changed, StageGuard(ctx, resume)))
        else:
            outcome = kind.run(ctx, inputs)
        wait_s = ctx.mirror.finish_wait_s if ctx.mirror is not None else 0.0  # e.g. paused for an operator
        return outcome
    except StagePreempted:
        wait_s = ctx.limits.preempt_grace_s / 2  # the newest step is the one a lost machine needs copied
        raise
    finally:
        if ctx.mirror is not None:
            ctx.mirror.close(wait_s=wait_s)


def stage_inputs(config: Config, stage: str, upstream: Record | dict[str, Any]) -> StageInputs:
    """`stage`'s inputs record from the config and its upstream (a record, or its JSON)."""
    kind = stage_kind(stage)
    if not isinstance(upstream, kind.upstream):
        upstream = kind.upstream.model_validate(upstream)
    return kind.inputs_from(config, upstream)
