"""Config sections of the stages: SFT, the reward model, the RL stage's loop (rl) and PPO's critic
(ppo), evaluation and the online labels. Assembled into `Config` by engine/config/schema.py."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlflow.engine.config.base import FunctionRef, Section, SupervisedSection, neutral, wiring

LOGGING = "how often metrics are logged, not what is trained"


class SFTConfig(SupervisedSection):
    rounds: Annotated[list[int], wiring("which rounds run SFT, not what one SFT stage computes")] = Field(
        default_factory=lambda: [0]
    )
    """The rounds (0-based) that start with SFT."""
    max_steps: int = Field(400, ge=1)
    """Most optimizer steps (the learning-rate schedule ends there)."""
    lr: float = Field(2e-3, gt=0)
    """Peak learning rate (AdamW): linear warmup, then cosine decay to 10% of it at max_steps."""
    warmup_steps: int = Field(20, ge=0)
    """Optimizer steps of linear learning-rate warmup."""
    eval_every: int = Field(25, ge=1)
    """Held-out loss (data.sft_eval) every this many steps, and at the last."""
    patience: int = Field(3, ge=1)
    """Held-out evals without a 1% improvement before stopping."""
    log_every: Annotated[int, neutral(LOGGING)] = Field(10, ge=1)
    """Log metrics every this many steps."""
    assistant_turns: Literal["all", "last"] = "all"
    """Which assistant turns of a `messages` row SFT learns: all (each with its EOS, the messages
    between them laid out as a multi-turn episode's observations and not learned; needs a chat
    template) or last (the earlier turns are context). A `prompt` + `response` row learns its
    response either way."""


class RewardModelConfig(SupervisedSection):
    init: Annotated[str, wiring("where the reward model starts: its upstream model, by content")] = "sft"
    """Where the reward model starts: "sft", the round's SFT checkpoint; otherwise a model path."""
    epochs: int = Field(2, ge=1)
    """Passes over the preference pairs (the learning-rate schedule ends after the last)."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate (AdamW): linear warmup, then cosine decay to 10% of it at the last step."""
    warmup_steps: int = Field(10, ge=0)
    """Optimizer steps of linear learning-rate warmup."""
    norm_samples: int = Field(256, ge=2)
    """Size of the fixed reference set for score mean/std: the first this many data.sft rows, scored
    at the stage's end; RL normalises the reward model's scores with them."""
    log_every: Annotated[int, neutral(LOGGING)] = Field(10, ge=1)
    """Log metrics every this many steps."""
    ensemble: int = Field(1, ge=1, le=32)
    """Score heads on the one backbone, each trained on its own bootstrap resample of the pairs
    (Poisson(1) weights): RL's reward is their mean, less reward.uncertainty_penalty x their
    spread, logged as critic/score_std_ensemble (docs/reward-ensemble.md). 1: one head."""


class RLConfig(Section):
    """The RL stage's loop, the same for every estimator (algorithm.name ppo, grpo, rloo, reinforce_pp)."""

    steps: int = Field(40, ge=1)
    """RL steps per round (fewer when kl.stop_above ends the round's RL)."""
    rollout_batch: int = Field(64, ge=1)
    """Prompts per RL step (each sampled rollout.n times)."""
    mini_batch: int = Field(32, ge=1)
    """Prompts (x rollout.n samples) per update; each mini-batch is one optimizer step, so it must divide
    rollout_batch."""
    epochs: int = Field(2, ge=1)
    """Passes of updates over each step's batch."""
    actor_lr: float = Field(5e-4, gt=0)
    """The actor's learning rate (AdamW, constant, no warmup)."""
    clip_ratio: float = Field(0.2, gt=0)
    """The policy loss's clip range of the policy ratio: 1 +- clip_ratio."""
    clip_ratio_low: float | None = Field(None, gt=0, le=1)
    """The ratio's lower bound is 1 - clip_ratio_low (DAPO's decoupled clip); None: clip_ratio."""
    clip_ratio_high: float | None = Field(None, gt=0)
    """The ratio's upper bound is 1 + clip_ratio_high (DAPO: 0.28 with clip_ratio_low 0.2); None: clip_ratio."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor of the returns (PPO's GAE and REINFORCE++)."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How the per-token losses are averaged, normalised over the whole mini-batch;
    seq-mean-token-sum-norm divides each row's sum by sampling.max_new_tokens (Dr. GRPO)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients (actor and critic) are clipped to this global norm."""
    log_every: Annotated[int, neutral(LOGGING)] = Field(1, ge=1)
    """Log metrics every this many steps."""

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(clip_low, clip_high): the ratio is clipped to [1 - clip_low, 1 + clip_high]."""
        low, high = self.clip_ratio_low, self.clip_ratio_high
        return (self.clip_ratio if low is None else low, self.clip_ratio if high is None else high)

    @model_validator(mode="after")
    def _whole_mini_batches(self) -> RLConfig:
        # Each mini-batch gets its own optimizer step with a loss normalised within it, so a short
        # last mini-batch (rollout_batch % mini_batch rows) would weigh its rows double and take a
        # noisier step; mini_batch > rollout_batch would silently shrink to rollout_batch. Both
        # change training without saying so, hence a rule (as in verl): mini-batches tile the batch.
        if self.rollout_batch % self.mini_batch:
            n, m = self.rollout_batch, self.mini_batch
            # The largest divisor not above mini_batch (its memory stays within what was asked), found
            # in bounded time: huge values fall back to the gcd, a common divisor too.
            below = range(min(n, m), max(0, min(n, m) - 100_000), -1)
            closest = next((d for d in below if n % d == 0), math.gcd(n, m))
            raise ValueError(
                f"rl.rollout_batch={self.rollout_batch} is not a multiple of rl.mini_batch={self.mini_batch}:"
                " every mini-batch is one optimizer step, so all must be the same size; set rl.mini_batch to a"
                f" divisor of rl.rollout_batch (e.g. {closest}) or rl.rollout_batch to a multiple of"
                f" rl.mini_batch (e.g. {-(-self.rollout_batch // self.mini_batch) * self.mini_batch})"
            )
        return self


class PPOConfig(Section):
    """What only PPO (algorithm.name=ppo) has: its critic and GAE."""

    critic_lr: float = Field(1e-3, gt=0)
    """The critic's learning rate (AdamW, constant, no warmup)."""
    value_clip: float = Field(0.2, gt=0)
    """Clip range of the critic's new values around its rollout-time values in the value loss."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda."""
    critic_init: Annotated[Literal["rm", "policy"], wiring("which model the critic starts from: its upstream")] = "rm"
    """Where the critic starts: the round's reward model (rm) or the policy (policy)."""
    critic_warmup_steps: int = Field(0, ge=0)
    """First steps of a round's RL in which only the critic learns."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to zero mean and unit variance over the batch."""


class EvalConfig(Section):
    every_steps: int = Field(10, ge=1)
    """The RL stage's evaluation every this many steps (and at its last); each round also ends with one."""
    num_prompts: int = Field(256, ge=1)
    """Evaluation prompts: the first this many of data.eval_prompts."""
    batch_size: int = Field(128, ge=1)
    """Prompts sampled together in an evaluation (each chunk seeded on its own)."""
    num_logged_samples: Annotated[int, neutral("how many answers are logged, not what is measured")] = Field(12, ge=0)
    """Answers each evaluation logs as a table (eval samples)."""
    curve_prompts: int | None = Field(None, ge=1)
    """The RL stage's evaluations every `every_steps` on the first this many of num_prompts; None: all."""
    greedy: bool = False
    """Greedy decoding in every evaluation (how verifiable-task accuracy is reported); false: the sampling section."""


class LabelConfig(Section):
    labeller: FunctionRef = Field(
        default_factory=lambda: FunctionRef(fn="rlflow.engine.tasksets.demo:noisy_gold_labeller", kwargs={"noise": 0.1})
    )
    """Online preference labeller: `fn(prompt, answer_a, answer_b, *, rng, **kwargs, **row fields)` returns
    0 (a preferred), 1 (b) or None (a tie, dropped); e.g. rlflow.engine.tasksets.gym:gym_labeller, a gym
    verifier's right answer over a wrong one."""
    online_from_round: Annotated[int | None, wiring("which rounds label online: the flow's")] = Field(1, ge=0)
    """First round whose policy answers are labelled online; None: offline preferences only; 0: pairs of the
    SFT policy."""
    prompts_per_round: int = Field(512, ge=1)
    """Prompts of data.prompts the policy answers twice per online round, one pair each."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Labelled pairs held out of RM training: rm/accuracy_online, the reward model's accuracy on the
    policy's own answers."""
    human_inbox: Annotated[str | None, wiring("the reward model reads the label files it holds, by content")] = None
    """Human labels (fsspec prefix): `rlflow label import` writes <inbox>/<run>/round_<n>.jsonl
    there; round r's reward model also trains on those of rounds < r. Watched by the
    label-inbox deployment, whose event starts the next round (prefect.yaml)."""
