"""What the RL stage (PPO, GRPO, RLOO, REINFORCE++) reads: its upstream models and the config it
trains with, built once by `inputs_from` for the flow (its identity), the stage's worker, `rlflow probe`
and every other caller of the RL-run entry point (engine/stages/rl/run.py)."""

from __future__ import annotations

from typing import Any, Literal

from rlflow.engine.config.base import FunctionRef, SectionView
from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.execution import CheckpointConfig, RolloutConfig
from rlflow.engine.config.hacking import HackingConfig
from rlflow.engine.config.kl import KLConfig
from rlflow.engine.config.methods import AlgorithmConfig, RewardConfig
from rlflow.engine.config.sampling import SamplingConfig
from rlflow.engine.config.schema import Config, DataConfig
from rlflow.engine.config.stages import EvalConfig, PPOConfig, RLConfig
from rlflow.engine.stages.context import Record
from rlflow.engine.stages.inputs import ModelInput, ModelLoading, RewardModelInput, StageInputs


class RLData(SectionView, source=DataConfig):
    """The data.* keys the RL stage reads: its prompts and those of its evaluations."""

    prompts: str
    eval_prompts: str
    max_prompt_tokens: int
    prompt_overflow: Literal["truncate", "drop"]
    chat_template: Literal["auto", "none"]
    storage_options: dict[str, Any]


class KeepBest(SectionView, source=CheckpointConfig):
    """checkpoint.keep_best: the evaluated step the stage keeps (and may roll back to)."""

    keep_best: str | None
    keep_best_mode: Literal["max", "min"]


class RLUpstream(Record):
    """The models the RL stage starts from (checkpoint step URIs or folders)."""

    policy: ModelInput  # the round's starting policy
    reference: ModelInput  # the KL anchor (kl.reference: the SFT policy or the round's start)
    sft: ModelInput  # the SFT policy, for eval/kl_to_sft
    reward_model: RewardModelInput | None = None  # the round's reward model; None: no source is it
    critic: ModelInput | None = None  # the critic's start (ppo.critic_init); None: a critic-free estimator


class RLInputs(StageInputs):
    """Everything the RL stage reads."""

    upstream: RLUpstream
    model: ModelLoading
    rl: RLConfig  # steps, batch sizes, epochs, the actor's learning rate, clipping
    ppo: PPOConfig | None  # the critic and GAE (algorithm.name=ppo); None: a critic-free estimator
    algorithm: AlgorithmConfig
    kl: KLConfig  # the reward penalty or loss term, its controller, the planned stop and the breaker
    sampling: SamplingConfig
    rollout: RolloutConfig  # samples per prompt, colocated or served sampling, off-policy schedules
    reward: RewardConfig  # the reward sources, their pool, the guards on failure
    eval: EvalConfig  # the evaluations during RL
    data: RLData
    gold: FunctionRef  # the gold score, called by evaluations only
    env: EnvConfig | None  # each prompt an episode of this environment; None: single-turn
    hacking: HackingConfig | None  # the reward-hacking detector; None: off
    checkpoint: KeepBest
    # With the detector on, its rollback target is a committed step: the cadence is an input then.
    rollback_every_steps: int | None


def inputs_from(config: Config, upstream: RLUpstream) -> RLInputs:
    hacking = config.hacking if config.hacking.enabled else None
    return RLInputs(
        seed=config.run.seed,
        upstream=upstream,
        model=ModelLoading.for_stage(config.model, "rl"),
        rl=config.rl,
        ppo=None if config.algorithm.critic_free else config.ppo,
        algorithm=config.algorithm,
        kl=config.kl,
        sampling=config.sampling,
        rollout=config.rollout,
        reward=config.reward,
        eval=config.eval,
        data=RLData.of(config.data),
        gold=config.gold,
        env=config.env,
        hacking=hacking,
        checkpoint=KeepBest.of(config.checkpoint),
        rollback_every_steps=None if hacking is None else config.checkpoint.every_steps,
    )
