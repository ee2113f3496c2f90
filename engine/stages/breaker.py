"""The RL stage's guards while training: the KL circuit breaker, reward-source failures, and the breach
record a stopped stage returns.

A breach is a result, not an error. The stage commits a checkpoint (the KL breach: the step that
tripped the breaker; a reward failure: the last completed step), writes no final.json (it is not
finished) and returns its StageOutcome with ``breach`` set; the flow asks an operator and runs the
stage again with ``StageOverrides``. That stage has the same identity, so it resumes from the
checkpoint. What the guards need across a resume (the breaker's count, an operator's max_kl, an
active fallback rule) travels in every checkpoint's meta under "guards".
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from rlflow.engine.backend import dist
from rlflow.engine.config.kl import KLConfig
from rlflow.engine.config.methods import RewardConfig
from rlflow.engine.config.base import FunctionRef
from rlflow.engine.errors import CheckpointError, RewardSourceError
from rlflow.engine.rewards.sources import FALLBACK_METRIC, FallbackState, RewardSource
from rlflow.engine.stages.context import Breach, StageContext, StageOutcome, StageOverrides
from rlflow.engine.storage.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

BREACH_KL = "kl"
BREACH_REWARD = "reward_failure"
KL_ABOVE_METRIC = "safety/kl_above_max_steps"


@dataclass(frozen=True)
class RLGuards:
    """One RL stage's guard settings: the KL breaker (kl.pause_above, kl.pause_patience), reward.*
    and an operator's overrides."""

    max_kl: float | None = None
    kl_patience: int = 3
    on_failure: str = "pause"  # reward.on_failure: pause | fallback_rule | fail
    fallback_rule: FunctionRef | None = None
    overrides: StageOverrides = field(default_factory=StageOverrides)

    @classmethod
    def of(cls, kl: KLConfig, reward: RewardConfig, overrides: StageOverrides | None = None) -> RLGuards:
        return cls(kl.pause_above, kl.pause_patience, reward.on_failure, reward.fallback_rule, overrides or StageOverrides())


@dataclass
class GuardState:
    """What the guards keep in a checkpoint's meta (JSON)."""

    kl_above: int = 0  # consecutive steps with rollout KL above max_kl
    max_kl_override: float | None = None  # an operator's max_kl
    override_base: float | None = None  # the kl.pause_above that override replaced
    breach: str | None = None  # set in the checkpoint a breach committed: a resume knows it continues one
    fallback: FallbackState | None = None

    @classmethod
    def from_json(cls, saved: dict[str, Any] | None) -> GuardState:
        saved = dict(saved or {})
        fallback = saved.pop("fallback", None)
        try:
            return cls(**saved, fallback=FallbackState(**fallback) if fallback else None)
        except TypeError as exc:  # written by another rlflow version
            raise CheckpointError(
                f"the checkpoint's guard state {sorted(saved)} does not match this rlflow version ({exc}); resume "
                "it with the version that wrote it (manifest meta 'versions')"
            ) from None


class RLSafety:
    """The guards of one running RL stage (created after the resume's state is restored)."""

    def __init__(
        self,
        guards: RLGuards,
        label: str,
        saved: dict[str, Any] | None,
        resume: int | None,
        controller: Any,
        reward: RewardSource,
    ):
        self.guards, self.label, self.state = guards, label, GuardState.from_json(saved)
        o, s = guards.overrides, self.state
        # An operator's max_kl outlives the flow run that set it (a later resume keeps it), unless
        # kl.pause_above itself changed since: then the config is the newer decision.
        if o.max_kl is not None:
            s.max_kl_override, s.override_base = o.max_kl, guards.max_kl
        elif s.max_kl_override is not None and s.override_base != guards.max_kl:
            s.max_kl_override = None
        self.max_kl = s.max_kl_override if s.max_kl_override is not None else guards.max_kl
        if s.breach == BREACH_KL:  # the operator chose to go on: the breaker counts afresh
            s.kl_above = 0
        s.breach = None
        if o.kl_coef is not None and (resume is None or o.from_step is None or resume <= o.from_step):
            controller.load_state_dict({"value": o.kl_coef})
            log.warning("%s: KL coefficient set to %g by the operator", label, o.kl_coef)
        if s.fallback is not None:
            log.warning("%s: the fallback reward rule %s stays active (it was before the resume)", label, s.fallback.fn)
        reward.fallback = s.fallback
        self.reward = reward

    def observe(self, step: int, metrics: dict[str, float], ended: bool) -> Breach | None:
        """After a step: add the guards' metrics; a Breach when the KL breaker trips (not on a
        step where kl.stop_above already ended the stage: that is a planned end)."""
        if self.reward.fallback is not None or self.guards.on_failure == "fallback_rule":
            metrics[FALLBACK_METRIC] = float(self.reward.fallback is not None)
        if self.max_kl is None:
            return None
        kl = metrics["actor/kl"]
        self.state.kl_above = self.state.kl_above + 1 if not kl <= self.max_kl else 0  # NaN counts as above
        metrics[KL_ABOVE_METRIC] = float(self.state.kl_above)
        if ended or self.state.kl_above < self.guards.kl_patience:
            return None
        message = (
            f"rollout KL {kl:.4g} stayed above kl.pause_above={self.max_kl:g} for {self.state.kl_above} consecutive"
            f" steps (kl.pause_patience={self.guards.kl_patience}); checkpoint committed at step {step}"
        )
        values = {"actor/kl": kl, "actor/kl_coef": metrics.get("actor/kl_coef", float("nan"))}
        limits = {"safety/max_kl": self.max_kl, "safety/kl_patience": float(self.guards.kl_patience)}
        return Breach(reason=BREACH_KL, step=step, metrics=values | limits, message=message)

    def reward_failed(self, exc: RewardSourceError, step: int, last: dict[str, float]) -> Breach | None:
        """The reward source failed in `step` (no update was made). reward.on_failure=fail raises;
        fallback_rule switches to the rule (None: run the step again); pause returns a Breach at
        the last completed step."""
        on_failure = self.guards.on_failure
        if on_failure == "fail":
            raise RewardSourceError(
                f"{self.label} step {step}: {exc}; reward.on_failure=fail stops the stage (its last committed"
                " checkpoint is intact): run again once the reward source works, or set reward.on_failure"
            ) from exc
        if on_failure == "fallback_rule" and self.reward.fallback is None:
            rule = self.reward.activate_fallback()
            log.warning(
                "%s step %d: %s; the fallback rule %s scores the rest of the stage", self.label, step, exc, rule
            )
            return None
        message = (
            f"the reward source failed at step {step} ({exc}); reward.on_failure=pause: checkpoint committed at"
            f" step {step - 1}"
        )
        values = {"reward/failed_step": float(step)} | ({"actor/kl": last["actor/kl"]} if "actor/kl" in last else {})
        return Breach(reason=BREACH_REWARD, step=step - 1, metrics=values, message=message)

    def summary(self) -> dict[str, float]:
        """For the stage's outcome: an active fallback changes the objective (the task tags it)."""
        return {FALLBACK_METRIC: 1.0} if self.reward.fallback is not None else {}

    def state_dict(self, breach: Breach | None = None) -> dict[str, Any]:
        """The guards' part of a checkpoint's meta; `breach`: this checkpoint is where one stopped."""
        state = dataclasses.replace(self.state, fallback=self.reward.fallback, breach=breach and breach.reason)
        return dataclasses.asdict(state)


def roll_back(store: CheckpointStore, step: int, replica: CheckpointStore | None = None) -> list[int]:
    """Delete a paused stage's steps after `step` (never `step` itself), on the primary and on the
    mirror (``replica``), so the stage continues from `step`; returns the deleted steps.

    Raises CheckpointError for a step that is not committed or a stage that already finished."""
    committed = store.committed_steps()
    if step not in committed:
        raise CheckpointError(
            f"cannot roll back to step {step} of {store.url}: it is not a committed step (committed: {committed})"
        )
    if store.final() is not None:
        raise CheckpointError(f"cannot roll back {store.url}: the stage already finished (final.json)")
    later = [n for n in committed if n > step]
    for target in (s for s in (store, replica) if s is not None):
        for n in target.committed_steps():
            if n > step:
                target.delete_step(n)
    return later


def paused_outcome(
    ctx: StageContext,
    breach: Breach,
    metrics: dict[str, float],
    resumed_from: int | None,
    changed: tuple[str, ...] = (),
) -> StageOutcome:
    """The outcome of a stage a breach stopped: its committed step, and no final.json."""
    return StageOutcome(
        stage=ctx.stage,
        round_index=ctx.round_index,
        step=breach.step,
        checkpoint_uri=ctx.store.step_url(breach.step),
        manifest_sha256=ctx.store.manifest_sha256(breach.step) if dist.is_main() else "",
        metrics={k: float(v) for k, v in metrics.items()},
        resumed_from=resumed_from,
        changed_keys=changed,
        breach=breach,
    )
