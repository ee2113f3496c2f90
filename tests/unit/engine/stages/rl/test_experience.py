"""Assembling RL experience from a scored rollout, on hand-made tensors: where the KL penalty
goes (each response token of the reward, or nowhere when it is a loss term), the score on each
row's last token, and the advantages and returns each estimator makes of them, against hand
arithmetic."""

import math

import pytest
import torch

from rlflow.engine.config.stages import RLConfig
from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.stages.rl.experience import (
    Objective,
    ScoredRollout,
    assemble_experience,
    experience_metrics,
)

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1 stopped after two tokens
OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -3.0, 0.0]])
# k1 = old - ref on the mask: [[0.5, 0, -0.5], [0, 1, (masked)]]
SCORES = torch.tensor([1.0, 2.0])
PLAIN = RLConfig(gamma=1.0)
UNWHITENED = Objective(lam=1.0, whiten_advantages=False)  # GAE with lambda 1, advantages as they are


def close(actual, expected):
    return torch.allclose(actual, torch.tensor(expected), atol=1e-5)


def rollout():
    batch = RolloutBatch(
        input_ids=torch.tensor([[9, 4, 5, 6], [9, 7, 8, 0]]),
        attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        response_mask=MASK,
        prompt_width=1,
        response_texts=("a", "b"),
    )
    return ScoredRollout(batch, REF, SCORES, OLD, torch.zeros(2, 3))


def test_the_kl_penalty_is_on_every_response_token_and_the_score_on_the_last():
    exp = assemble_experience(rollout(), OLD * MASK, torch.zeros(2, 3), kl_coef=0.1, cfg=PLAIN, objective=UNWHITENED)
    # row 0: -0.1 x [0.5, 0, -0.5], + 1 on its third token; row 1: -0.1 x [0, 1], + 2 on its second
    assert close(exp.token_rewards, [[-0.05, 0.0, 1.05], [0.0, 1.9, 0.0]])
    # gamma = lam = 1 and zero values: GAE's advantage is the reward still to come, and so is the return
    assert close(exp.advantages, [[1.0, 1.05, 1.05], [1.9, 1.9, 0.0]])
    assert close(exp.returns, [[1.0, 1.05, 1.05], [1.9, 1.9, 0.0]])
    assert exp.scores is SCORES and exp.ref_logprobs is REF


def test_discounting_and_values_enter_gae_as_hand_computed():
    objective = Objective(lam=0.5, whiten_advantages=False)
    values = torch.tensor([[0.5, 0.25, 1.0], [0.0, 0.0, 0.0]]) * MASK
    exp = assemble_experience(rollout(), OLD * MASK, values, kl_coef=0.0, cfg=RLConfig(gamma=0.5), objective=objective)
    # row 0, rewards [0, 0, 1]: deltas r_t + 0.5 V_{t+1} - V_t = [-0.375, 0.25, 0]; A_t = delta_t + 0.25 A_{t+1}
    a2 = 1.0 - 1.0
    a1 = (0.0 + 0.5 * 1.0 - 0.25) + 0.25 * a2
    a0 = (0.0 + 0.5 * 0.25 - 0.5) + 0.25 * a1
    assert exp.advantages[0].tolist() == pytest.approx([a0, a1, a2])
    assert exp.returns[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.25, a2 + 1.0])


def test_a_kl_loss_term_leaves_the_reward_without_kl():
    objective = Objective(kl_in_loss=True, kl_loss_coef=0.5)
    exp = assemble_experience(rollout(), OLD * MASK, torch.zeros(2, 3), kl_coef=0.1, cfg=PLAIN, objective=objective)
    assert exp.token_rewards.tolist() == [[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]


def test_grpo_gives_each_sample_its_groups_standardised_score_on_every_token():
    objective = Objective(estimator="grpo", group_size=2, kl_in_loss=True)
    exp = assemble_experience(rollout(), OLD * MASK, torch.zeros(2, 3), kl_coef=0.1, cfg=PLAIN, objective=objective)
    # one group, scores 1 and 2: mean 1.5, unbiased std sqrt(0.5)
    half = 0.5 / math.sqrt(0.5)
    assert close(exp.advantages, [[-half] * 3, [half, half, 0.0]])
    assert torch.equal(exp.returns, exp.advantages)


def test_whitened_ppo_advantages_have_zero_mean_over_response_tokens():
    objective = Objective(lam=1.0, whiten_advantages=True)
    exp = assemble_experience(rollout(), OLD * MASK, torch.zeros(2, 3), kl_coef=0.1, cfg=PLAIN, objective=objective)
    kept = exp.advantages[MASK.bool()]
    raw = torch.tensor([1.0, 1.05, 1.05, 1.9, 1.9])
    assert float(kept.mean()) == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(kept.argsort(), raw.argsort())  # an affine map: the order of tokens is kept


def test_rollout_metrics_from_hand_numbers():
    exp = assemble_experience(rollout(), OLD * MASK, torch.zeros(2, 3), kl_coef=0.1, cfg=PLAIN, objective=UNWHITENED)
    metrics = experience_metrics(exp, kl_coef=0.1, has_critic=False)
    # k3 = exp(ref - old) - (ref - old) - 1 on the five response tokens
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.0, 0.5, 0.0, -1.0)]
    assert metrics["actor/kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert (metrics["critic/score/mean"], metrics["critic/score/max"], metrics["critic/score/min"]) == (1.5, 2.0, 1.0)
    assert metrics["response_length/mean"] == 2.5
    assert metrics["critic/rewards/mean"] == pytest.approx((-0.05 + 1.05 + 1.9) / 5)
    assert "critic/values/mean" not in metrics
    with_critic = experience_metrics(exp, kl_coef=0.1)
    assert with_critic["critic/values/mean"] == 0.0
