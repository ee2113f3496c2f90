"""The one KL section: the RL stage's KL to its reference policy, all in `kl.*`.

Where it acts (a per-token penalty in the reward, or a term of the actor's loss), its estimator,
its coefficient and controller, and the two limits on it: the planned end of a round's RL
(`stop_above`) and the circuit breaker that pauses the run (`pause_above`). DPO's implicit KL is
its own method's (dpo.beta, dpo.reference).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlflow.engine.config.base import Section, neutral, wiring

BREAKER = "the circuit breaker: an operator may change it to continue a paused stage, which stays the same stage"

# engine/algorithms/kl.py KL_ESTIMATORS' keys (tests/unit/engine/algorithms/test_advantages.py checks they agree).
KLEstimator = Literal["k1", "k2", "k3", "abs", "low_var_kl"]
# Where each algorithm puts the KL by default: in the per-token reward, or as a loss term of the
# actor (GRPO, as in DeepSeekMath).
DEFAULT_KL_IN_LOSS = {"ppo": False, "grpo": True, "rloo": False, "reinforce_pp": False, "dpo": False}
# The estimator of each placement when kl.estimator is unset: k1 is the classic reward penalty
# (Ziegler et al. 2019); low_var_kl is verl's loss term (k3 bounded).
DEFAULT_ESTIMATOR = {False: "k1", True: "low_var_kl"}


class KLConfig(Section):
    reference: Annotated[
        Literal["sft", "round_start"], wiring("which policy is the reference: an upstream model")
    ] = "sft"
    """The KL anchor: the round's SFT policy (sft) or the policy the round starts from (round_start)."""
    in_loss: bool | None = None
    """The KL as a loss term of the actor (true) or a per-token penalty in the reward (false); None: the
    algorithm's default (GRPO: loss; PPO, RLOO, REINFORCE++: reward)."""
    estimator: KLEstimator | None = None
    """Per-token estimator of KL(policy || reference), wherever the KL acts (docs/algorithms.md lists each
    one's bias); None: k1 in the reward, low_var_kl (k3 bounded, as in verl) in the loss."""
    coef: float = Field(0.05, ge=0)
    """The reward penalty's coefficient at the start of the RL stage (constant with controller fixed)."""
    controller: Literal["fixed", "adaptive"] = "adaptive"
    """The reward penalty's coefficient: fixed at coef, or adapted towards `target` (Ziegler et al. 2019)."""
    target: float = Field(0.05, gt=0)
    """Token-mean KL the adaptive controller aims at (nats)."""
    horizon: int = Field(2000, ge=1)
    """The adaptive controller's horizon in sampled responses: a step moves the coefficient by at most
    20% x (the step's responses / horizon)."""
    loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss term (fixed: the controller steers only the reward penalty)."""
    stop_above: float | None = Field(0.3, gt=0)
    """End the round's RL once the rollout KL passes this (a planned end); None: never."""
    pause_above: Annotated[float | None, neutral(BREAKER)] = Field(None, gt=0)
    """Circuit breaker: pause the run once the rollout KL stays above this for `pause_patience` steps;
    None: off."""
    pause_patience: Annotated[int, neutral(BREAKER)] = Field(3, ge=1)
    """Consecutive steps above pause_above that trip the breaker."""

    def placed_in_loss(self, algorithm: str) -> bool:
        """Whether the KL is a loss term for this algorithm (algorithm.name)."""
        return DEFAULT_KL_IN_LOSS[algorithm] if self.in_loss is None else self.in_loss

    def estimator_for(self, in_loss: bool) -> str:
        return DEFAULT_ESTIMATOR[in_loss] if self.estimator is None else self.estimator
