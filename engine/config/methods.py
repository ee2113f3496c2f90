"""Config sections of the training method: the RL algorithm, DPO and the reward sources.

Kept apart from engine/config/schema.py (run, data, engine and stage sections) so that each file stays
one idea; `Config` composes both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from rlflow.engine.config.base import (
    FunctionRef,
    Section,
    SupervisedSection,
    by_content,
    function_ref,
    neutral,
    one_of,
    wiring,
)

GUARD = "a guard: what happens after a reward failure, which an operator may change to continue a paused stage"

# The policy-gradient estimators (engine/algorithms/advantages.py ADVANTAGE_ESTIMATORS) and DPO, which
# replaces the reward-model and RL stages of a round.
ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "dpo")
# engine/algorithms/policy_losses.py POLICY_LOSSES and engine/algorithms/rollout_correction.py CORRECTIONS.
POLICY_LOSSES = ("ppo", "gspo", "cispo")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


class AlgorithmConfig(Section):
    """Which method trains the policy each round (one key to switch: algorithm.name)."""

    name: Annotated[str, one_of(ALGORITHMS, "algorithm.name")] = "ppo"
    """The method: ppo, grpo, rloo, reinforce_pp (policy-gradient estimators of the RL stage) or dpo
    (replaces the round's reward-model and RL stages); see docs/algorithms.md."""
    norm_std: bool = True
    """GRPO: divide each group's centred scores by the group's std (Dr. GRPO sets this off)."""
    policy_loss: Annotated[str, one_of(POLICY_LOSSES, "algorithm.policy_loss")] = "ppo"
    """The per-token policy loss: ppo (clipped ratio, rl.clip_ratio_low/high), gspo (one clipped
    ratio per sequence) or cispo (clipped, detached importance weight times the log-prob); see
    docs/algorithms.md."""
    rollout_correction: Annotated[str, one_of(ROLLOUT_CORRECTIONS, "algorithm.rollout_correction")] = "none"
    """Importance weight pi_trainer / pi_sampler of each sampled token on its loss: none, tis
    (truncated at correction_cap) or mis (tokens or sequences outside [1/cap, cap] masked)."""
    correction_cap: float = Field(2.0, gt=1)
    """The cap C of rollout_correction: tis truncates weights at C, mis masks those outside [1/C, C]."""
    correction_level: Literal["token", "sequence"] = "token"
    """Whether the correction's weight is each token's ratio or its sequence's (product over tokens)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no advantage) and sample more prompts until the
    batch has rl.rollout_batch informative groups or dynamic_sampling_max_tries samplings were made."""
    dynamic_sampling_max_tries: int = Field(3, ge=1)
    """Most samplings of rl.rollout_batch prompts per step with dynamic_sampling; a batch still short
    after them is filled with the dropped groups (rollout/underfilled_groups counts them)."""

    @property
    def critic_free(self) -> bool:
        return self.name in ("grpo", "rloo", "reinforce_pp")


class DPOConfig(SupervisedSection):
    """Direct Preference Optimisation (Rafailov et al. 2023) as a round's training stage."""

    beta: float = Field(0.1, gt=0)
    """DPO's temperature β: the strength of the implicit KL to the reference."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO: the assumed label-flip rate; 0: plain DPO."""
    rpo_alpha: float = Field(0.0, ge=0)
    """Weight of the chosen answers' per-token NLL (RPO); 0: plain DPO, 1 is recommended for online DPO."""
    reference: Annotated[Literal["sft", "round_start"], wiring("which policy is the reference: an upstream model")] = (
        "round_start"
    )
    """The reference policy: the round's SFT policy (sft) or the policy the round starts from
    (round_start)."""
    include_offline: bool = True
    """Online rounds: train on data.preferences besides the round's fresh pairs."""
    epochs: int = Field(1, ge=1)
    """Passes over the round's preference pairs."""
    lr: float = Field(5e-5, gt=0)
    """Peak learning rate (AdamW): linear warmup, then cosine decay to 10% of it at the last step."""
    warmup_steps: int = Field(5, ge=0)
    """Optimizer steps of linear learning-rate warmup."""
    log_every: Annotated[int, neutral("how often metrics are logged, not what is trained")] = Field(5, ge=1)
    """Log metrics every this many steps."""


RULE_TYPES = ("keyword", "regex", "length", "format", "exact_match", "gym")
SOURCE_TYPES = ("model", "function", *RULE_TYPES)


class RewardSourceConfig(Section):
    """One term of the reward: weight x score. `type` chooses what computes the score:

    model: a learned reward model (`path` null: the round's reward-model stage; else a folder);
    function: `fn` ("module:function", `(prompt, response, **fields) -> float`) with `kwargs`;
    keyword / regex / length / format / exact_match: built-in rules with `kwargs`
    (engine/rewards/rules.py documents each rule's arguments);
    gym: the prompt row's reasoning-gym verifier (engine/tasksets/gym.py gym_rule).
    `on_error` overrides reward.on_error for this source; a gym source skips by default (a
    malformed answer or a verifier's failure scores 0 and is counted, never stops the run).
    """

    name: str
    """The source's name (letters, digits, '_', '-', '.'), unique: its metrics are reward/<name>/..."""
    type: Annotated[str, one_of(SOURCE_TYPES, "reward source type")]
    """What computes the score: model, function, keyword, regex, length, format, exact_match or gym."""
    weight: float = 1.0
    """The score's weight in the reward (sum of weight x score over the sources)."""
    path: Annotated[str | None, by_content("model")] = None
    """Type model only: a reward-model folder (raw scores); None: the round's reward-model stage
    (scores normalised by its mean and std)."""
    fn: Annotated[str | None, by_content("function")] = None
    """Type function only: "module:function", called as `(prompt, response, **fields, **kwargs) -> float`."""
    kwargs: Annotated[dict[str, Any], by_content("kwargs")] = Field(default_factory=dict)
    """Keyword arguments of the function, or of the rule (engine/rewards/rules.py documents each rule's;
    gym: extract answer_tag, last_number or full, and credit exact or partial)."""
    on_error: Literal["fail", "skip"] | None = None
    """Overrides reward.on_error for this source; None: reward.on_error (a gym source: skip)."""

    def error_policy(self, default: str) -> str:
        """This source's effective on_error, given reward.on_error."""
        return self.on_error or ("skip" if self.type == "gym" else default)

    @field_validator("name")
    @classmethod
    def _metric_safe(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "_-." for c in value):
            raise ValueError(f"reward source name {value!r} must be letters, digits, '_', '-' or '.'")
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
    """The terms of the reward (see docs/rewards.md): a sample's score is sum of weight x score."""
    timeout_s: Annotated[float, neutral("a time limit: which calls exceed it depends on the machine")] = Field(
        10.0, gt=0
    )
    """Time limit of each call of a function or rule, in seconds."""
    on_error: Literal["fail", "skip"] = "fail"
    """A function that raises, returns a non-finite value or times out: stop with an error naming
    it and the sample (fail), or score that sample 0 for this source and count it (skip)."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft overlong penalty: an answer longer than sampling.max_new_tokens - overlong_buffer
    tokens loses overlong_penalty x its excess / overlong_buffer (the whole penalty at the limit); None: off."""
    overlong_penalty: float = Field(1.0, gt=0)
    """The overlong penalty of an answer that reaches sampling.max_new_tokens, in reward units."""
    valid: str | None = None
    """The declared valid rule: the name of a reward source that scores 1 for a valid answer and 0
    otherwise (weight 0 keeps it out of the reward). The evaluations' eval/valid_fraction, which the
    promotion gates read, and the hacking detector's valid share come from it; None: the gold's
    "valid" component (or a positive gold score)."""
    judge: str | None = None
    """The independent judge: the name of a reward source of weight 0 (it never enters the reward, so
    it is not optimised): a rule, a function or a second reward model (type model with a path). The
    hacking detector compares the proxy reward with it during RL, and every evaluation scores the
    start's and the candidate's answers with it (eval/judge_score, eval/judge_gain, eval/judge_agreement)
    for the promotion gates; None: no judge."""
    uncertainty_penalty: float = Field(0.0, ge=0)
    """λ of an ensemble reward model's reward, mean - λ x std over its heads (rm.ensemble >= 2):
    answers the heads disagree on, where the reward model is least trustworthy, earn less."""
    workers: Annotated[int, neutral("a process count: how the scores are computed, not what they are")] = Field(
        2, ge=1, le=256
    )
    """Processes that run the function and rule sources."""
    on_failure: Annotated[Literal["pause", "fallback_rule", "fail"], neutral(GUARD)] = "pause"
    """When the learned reward model itself fails (non-finite scores): pause (the run waits for an
    operator at a committed checkpoint), fallback_rule (reward.fallback_rule scores the rest of the
    stage) or fail."""
    fallback_rule: Annotated[FunctionRef | None, neutral(GUARD)] = None
    """The rule reward of on_failure=fallback_rule (score signature of gold.fn); it replaces the whole
    reward, its scores standardised by the first batch it scores."""

    @model_validator(mode="after")
    def _consistent(self) -> RewardConfig:
        if self.on_failure == "fallback_rule" and self.fallback_rule is None:
            raise ValueError("reward.on_failure=fallback_rule needs reward.fallback_rule.fn (a 'module:function')")
        if not self.sources:
            raise ValueError("reward.sources is empty: give at least one source (e.g. {name: rm, type: model})")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"reward.sources names must be unique, got {names}")
        if self.valid is not None and self.valid not in names:
            raise ValueError(f"reward.valid={self.valid!r} is not a reward source; reward.sources has {sorted(names)}")
        if self.valid is not None and next(s for s in self.sources if s.name == self.valid).type == "model":
            raise ValueError(f"reward.valid={self.valid!r} is a reward model; a valid rule is a rule or a function")
        if self.judge is not None:
            self._check_judge(names)
        return self

    def _check_judge(self, names: list[str]) -> None:
        if self.judge not in names:
            raise ValueError(f"reward.judge={self.judge!r} is not a reward source; reward.sources has {sorted(names)}")
        judge = next(s for s in self.sources if s.name == self.judge)
        if judge.weight != 0:
            raise ValueError(
                f"reward.judge={self.judge!r} has weight {judge.weight}: a judge inside the reward is optimised"
                " too, so it cannot tell the reward's gain from the task's; give it weight: 0"
            )
        if judge.type == "model" and judge.path is None:
            raise ValueError(
                f"reward.judge={self.judge!r} is the round's own reward model, the proxy it must check; name a"
                " rule, a function or a second reward model (type: model with path: its folder)"
            )

    @property
    def learned(self) -> bool:
        """Whether the round's own reward-model stage is one of the sources."""
        return any(s.type == "model" and s.path is None for s in self.sources)
