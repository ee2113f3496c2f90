"""Config sections of the training method: the RL algorithm, DPO and the reward sources.

Kept apart from engine/config.py (run, data, engine and stage sections) so that each file stays
one idea; `Config` composes both.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from rlflow.engine.config_base import FunctionRef, Section, function_ref

# The policy-gradient estimators (engine/advantages.py ADVANTAGE_ESTIMATORS) and DPO, which
# replaces the reward-model and RL stages of a round.
ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "dpo")
# Where each estimator puts the KL to the reference by default: in the per-token reward, or as a
# loss term of the actor (GRPO, as in DeepSeekMath).
DEFAULT_KL_IN_LOSS = {"ppo": False, "grpo": True, "rloo": False, "reinforce_pp": False, "dpo": False}


class AlgorithmConfig(Section):
    """Which method trains the policy each round (one key to switch: algorithm.name)."""

    name: str = "ppo"
    # GRPO: divide each group's centred scores by the group's std (Dr. GRPO sets this off).
    norm_std: bool = True
    # None: the estimator's default (GRPO: loss; PPO, RLOO, REINFORCE++: reward).
    use_kl_loss: bool | None = None
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    kl_loss_coef: float = Field(0.001, ge=0)

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in ALGORITHMS:
            raise ValueError(f"unknown algorithm.name {value!r}; valid: {', '.join(ALGORITHMS)}")
        return value

    @property
    def critic_free(self) -> bool:
        return self.name in ("grpo", "rloo", "reinforce_pp")

    @property
    def kl_in_loss(self) -> bool:
        return DEFAULT_KL_IN_LOSS[self.name] if self.use_kl_loss is None else self.use_kl_loss


class DPOConfig(Section):
    """Direct Preference Optimisation (Rafailov et al. 2023) as a round's training stage."""

    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # conservative DPO: assumed label-flip rate
    rpo_alpha: float = Field(0.0, ge=0)  # weight of the chosen answers' per-token NLL (RPO); 0: plain DPO
    reference: Literal["sft", "round_start"] = "round_start"
    include_offline: bool = True  # online rounds: data.preferences besides the round's fresh pairs
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)  # pairs per optimizer step
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_seq_tokens: int = Field(128, ge=8)
    log_every: int = Field(5, ge=1)


RULE_TYPES = ("keyword", "regex", "length", "format", "exact_match", "gym")
SOURCE_TYPES = ("model", "function", *RULE_TYPES)


class RewardSourceConfig(Section):
    """One term of the reward: weight x score. `type` chooses what computes the score:

    model: a learned reward model (`path` null: the round's reward-model stage; else a folder);
    function: `fn` ("module:function", `(prompt, response, **fields) -> float`) with `kwargs`;
    keyword / regex / length / format / exact_match: built-in rules with `kwargs`
    (engine/reward_rules.py documents each rule's arguments);
    gym: the prompt row's reasoning-gym verifier (engine/gym_task.py gym_rule).
    `on_error` overrides reward.on_error for this source; a gym source skips by default (a
    malformed answer or a verifier's failure scores 0 and is counted, never stops the run).
    """

    name: str
    type: str
    weight: float = 1.0
    path: str | None = None  # type model
    fn: str | None = None  # type function
    kwargs: dict[str, Any] = Field(default_factory=dict)
    on_error: Literal["fail", "skip"] | None = None  # None: reward.on_error (a gym source: skip)

    def error_policy(self, default: str) -> str:
        """This source's effective on_error, given reward.on_error."""
        return self.on_error or ("skip" if self.type == "gym" else default)

    @field_validator("name")
    @classmethod
    def _metric_safe(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "_-." for c in value):
            raise ValueError(f"reward source name {value!r} must be letters, digits, '_', '-' or '.'")
        return value

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in SOURCE_TYPES:
            raise ValueError(f"unknown reward source type {value!r}; valid: {', '.join(SOURCE_TYPES)}")
        return value

    @model_validator(mode="after")
    def _fields_of_type(self) -> RewardSourceConfig:
        if self.type == "function":
            if self.fn is None:
                raise ValueError(f"reward source {self.name!r} (type function) needs fn: 'module:function'")
            function_ref(self.fn)
        elif self.fn is not None:
            raise ValueError(f"reward source {self.name!r}: fn is only for type function, not {self.type!r}")
        if self.path is not None and self.type != "model":
            raise ValueError(f"reward source {self.name!r}: path is only for type model, not {self.type!r}")
        return self


def _default_sources() -> list[RewardSourceConfig]:
    return [RewardSourceConfig(name="rm", type="model")]


class RewardConfig(Section):
    """What the RL stage's reward is made of, and what happens when a source fails."""

    sources: list[RewardSourceConfig] = Field(default_factory=_default_sources)
    timeout_s: float = Field(10.0, gt=0)  # per call of a function or rule
    # A function that raises, returns a non-finite value or times out: stop with an error naming
    # it and the sample (fail), or score that sample 0 for this source and count it (skip).
    on_error: Literal["fail", "skip"] = "fail"
    workers: int = Field(2, ge=1, le=256)  # processes that run function and rule sources
    # The learned reward model itself fails (non-finite scores): see engine/reward_source.py.
    on_failure: Literal["pause", "fallback_rule", "fail"] = "pause"
    fallback_rule: FunctionRef | None = None  # a rule reward (score signature of gold.fn) for fallback_rule

    @model_validator(mode="after")
    def _consistent(self) -> RewardConfig:
        if self.on_failure == "fallback_rule" and self.fallback_rule is None:
            raise ValueError("reward.on_failure=fallback_rule needs reward.fallback_rule.fn (a 'module:function')")
        if not self.sources:
            raise ValueError("reward.sources is empty: give at least one source (e.g. {name: rm, type: model})")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"reward.sources names must be unique, got {names}")
        return self

    @property
    def learned(self) -> bool:
        """Whether the round's own reward-model stage is one of the sources."""
        return any(s.type == "model" and s.path is None for s in self.sources)
