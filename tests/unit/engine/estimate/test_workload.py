"""Workloads and strategies (rlflow.engine.estimate.workload): what GRPO, a critic-free method and
rule rewards change in a workload's rows, memory and time, and strategies that cannot run.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from helpers.workloads import workload
from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.hardware import device_spec, load_price_book
from rlflow.engine.estimate.memory import (
    GPU_FRAGMENTATION,
    estimate_memory,
    partitioned_states,
)
from rlflow.engine.estimate.model_shape import (
    REFERENCE_SHAPES,
)
from rlflow.engine.estimate.timing import (
    generation_seconds,
    scoring_seconds,
    training_seconds,
)
from rlflow.engine.estimate.workload import PRECISIONS, Strategy, Workload

ROOT = Path(__file__).parents[4]
PRICES = load_price_book(ROOT / "configs" / "prices.yaml")
A100 = device_spec(PRICES, "a100-80g")
BF16 = PRECISIONS["bf16-mixed"]
LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]
QWEN_05B = REFERENCE_SHAPES["Qwen2.5-0.5B"]


def grpo_of(ppo: Workload, n: int = 4) -> Workload:
    """The GRPO workload with the same rows as `ppo`: 1/n of its prompts x n samples, no critic."""
    prompts, mini = ppo.rollout_batch // n, ppo.mini_batch // n
    return replace(
        ppo,
        algorithm="grpo",
        critic=None,
        samples_per_prompt=n,
        kl_in_loss=True,
        rollout_batch=prompts,
        mini_batch=mini,
    )


def test_grpo_16_prompts_x_4_samples_samples_and_scores_what_ppo_with_64_prompts_does():
    ppo = workload(LLAMA_8B)  # 64 prompts, mini-batch 32
    grpo = grpo_of(ppo)
    assert (grpo.rollout_batch, grpo.samples_per_prompt) == (16, 4)
    assert grpo.rows == ppo.rows == 64 and grpo.mini_rows == ppo.mini_rows == 32 and grpo.chunks == ppo.chunks == 4
    s = Strategy(3, 8)
    assert generation_seconds(grpo, s, A100, estimate_memory(grpo, s, A100)) == generation_seconds(
        ppo, s, A100, estimate_memory(ppo, s, A100)
    )
    # The same rows through the reference and the reward model; PPO adds the critic's values pass
    # and the critic's update, GRPO nothing (its KL is a loss term on the reference log-probs).
    assert scoring_seconds(grpo, s, A100) == scoring_seconds(replace(ppo, critic=None), s, A100)
    assert scoring_seconds(grpo, s, A100)[0] < scoring_seconds(ppo, s, A100)[0]
    assert training_seconds(grpo, s, A100) == training_seconds(replace(ppo, critic=None), s, A100)
    # A vLLM server holds the KV cache of all rows of the step, prompts x samples.
    vllm = {"rollout_engine": "vllm", "rollout_gpus": 1}
    concurrency = [estimate_memory(replace(w, **vllm), s, A100).rollout_concurrency for w in (ppo, grpo)]
    assert concurrency == [64, 64]
    assert "GRPO: 16 prompts x 4 samples = 64 rows per step, no critic, KL in the loss" in grpo.label


@pytest.mark.parametrize("strategy", [Strategy(0, 1), Strategy(1, 8), Strategy(3, 8)], ids=lambda s: s.label)
def test_critic_free_memory_is_smaller_by_exactly_the_critics_states(strategy):
    ppo = workload(LLAMA_8B, critic=QWEN_05B)
    grpo = grpo_of(ppo)
    weights, grads, optimizer = partitioned_states(QWEN_05B.scalar_params, BF16, strategy.zero_stage, strategy.n_gpus)
    for with_critic, without in zip(
        estimate_memory(ppo, strategy, A100).phases, estimate_memory(grpo, strategy, A100).phases
    ):
        critic = {"critic_weights": weights, "optimizer_states": optimizer}
        if (
            with_critic.phase == "training" and strategy.zero_stage > 0
        ):  # the torch backend frees each model's at its step
            critic["gradients"] = grads
        less = {k: v - without.components()[k] for k, v in with_critic.components().items()}
        assert less.pop("framework_overhead") == pytest.approx(GPU_FRAGMENTATION * sum(critic.values()))
        assert less == pytest.approx(dict.fromkeys(less, 0.0) | critic), with_critic.phase


def test_rule_rewards_need_no_reward_model_and_a_reward_model_by_path_costs_like_the_rounds():
    ppo, s = workload(LLAMA_8B), Strategy(3, 8)
    rules = replace(ppo, reward=None)  # reward.sources: rules and functions only, in CPU workers
    assert all(p.reward_weights == 0 for p in estimate_memory(rules, s, A100).phases)
    assert scoring_seconds(rules, s, A100)[0] < scoring_seconds(ppo, s, A100)[0]
    by_path = replace(ppo, reward=None, extra_rewards=(LLAMA_8B,))
    assert estimate_memory(by_path, s, A100) == estimate_memory(ppo, s, A100)
    assert scoring_seconds(by_path, s, A100) == scoring_seconds(ppo, s, A100)


def test_impossible_strategies_are_refused():
    with pytest.raises(ConfigError, match="--zero 0 is the torch backend"):
        Strategy(0, 2)
    with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
        Strategy(2, 8, offload="all")
    with pytest.raises(ConfigError, match="unknown offload 'cpu'.*valid: none, optimizer, all"):
        Strategy(3, 8, offload="cpu")
