"""The advantage estimators on small tensors, against hand arithmetic (the KL estimators: test_kl.py)."""

import math
import types
import typing

import pytest
import torch

from rlflow.engine.algorithms import advantages as adv
from rlflow.engine.algorithms import kl
from rlflow.engine.algorithms.advantages import compute_gae_advantages
from rlflow.engine.config.schema import load_config
from rlflow.engine.config.kl import DEFAULT_ESTIMATOR, DEFAULT_KL_IN_LOSS, KLConfig, KLEstimator
from rlflow.engine.config.execution import RolloutConfig
from rlflow.engine.config.methods import ALGORITHMS, AlgorithmConfig, RewardConfig
from rlflow.engine.config.sampling import SamplingConfig, SamplingParams
from rlflow.engine.config.stages import PPOConfig
from rlflow.engine.stages.rl.experience import Objective

T = torch.tensor


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0)


def scores_at_end(scores, lengths, width=3):
    """token rewards [B, T] holding each score on its row's last real token, and the mask."""
    mask = torch.zeros(len(scores), width)
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1.0
        rewards[i, n - 1] = s
    return rewards, mask


def test_grpo_by_hand_with_and_without_std():
    # group 1: returns 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 2: 2, 4, 6, 8 -> mean 5, std sqrt(20/3)
    rewards, mask = scores_at_end([1, 0, 0, 1, 2, 4, 6, 8], [1, 2, 3, 1, 2, 2, 3, 1])
    a, r = adv.compute_grpo_outcome_advantages(rewards, mask, group_size=4, norm_std=True)
    s1, s2 = math.sqrt(1 / 3), math.sqrt(20 / 3)
    expected_rows = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, -3 / s2, -1 / s2, 1 / s2, 3 / s2]
    close(a, torch.tensor(expected_rows).unsqueeze(-1) * mask, atol=1e-4)
    assert torch.equal(a, r)
    a, _ = adv.compute_grpo_outcome_advantages(rewards, mask, group_size=4, norm_std=False)
    close(a, torch.tensor([0.5, -0.5, -0.5, 0.5, -3, -1, 1, 3.0]).unsqueeze(-1) * mask)


def test_equal_rewards_give_zero_advantage_and_no_nan():
    rewards, mask = scores_at_end([0.7] * 4 + [0.0] * 4, [1, 2, 3, 2] * 2)
    for name in ("grpo", "rloo"):
        a, r = adv.compute_advantages(name, rewards, torch.zeros_like(rewards), mask, group_size=4)
        assert torch.isfinite(a).all() and torch.isfinite(r).all()
        close(a, torch.zeros_like(a))


def test_rloo_is_the_leave_one_out_baseline():
    rewards, mask = scores_at_end([1.0, 2.0, 6.0, 3.0, 3.0, 0.0], [1, 3, 2, 1, 1, 2])
    a, _ = adv.compute_rloo_outcome_advantages(rewards, mask, group_size=3)
    # group 1: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5; group 2: 3-1.5, 3-1.5, 0-3
    close(a, torch.tensor([-3.0, -1.5, 4.5, 1.5, 1.5, -3.0]).unsqueeze(-1) * mask)
    # the identity RLOO = n / (n - 1) * (x - group mean)
    g, _ = adv.compute_grpo_outcome_advantages(rewards, mask, 3, norm_std=False)
    close(a, g * 3 / 2)
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        adv.compute_rloo_outcome_advantages(rewards, mask, group_size=1)


def test_outcome_estimators_sum_kl_penalties_into_the_return():
    # a row's return is the sum of its token rewards: score 1 at the end, -0.1 KL on each of 2 tokens
    rewards = T([[-0.1, 0.9, 0.0], [0.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    a, _ = adv.compute_rloo_outcome_advantages(rewards, mask, 2)
    close(a, T([[0.8, 0.8, 0.0], [-0.8, 0.0, 0.0]]))


def test_reinforce_pp_returns_and_global_whitening_by_hand():
    rewards = T([[-0.1, -0.1, 1.0], [-0.2, 0.5, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a, r = adv.compute_reinforce_pp_advantages(rewards, mask, gamma=1.0)
    close(r, T([[0.8, 0.9, 1.0], [0.3, 0.5, 0.0]]))
    vals = torch.tensor([0.8, 0.9, 1.0, 0.3, 0.5])
    expected = (vals - vals.mean()) / vals.std()
    close(a[mask.bool()], expected, atol=1e-4)
    assert a[1, 2] == 0.0
    _, r = adv.compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(r[0], [-0.1 - 0.05 + 0.25, -0.1 + 0.5, 1.0])


def test_ppo_entry_is_gae():
    rewards = T([[0.0, 1.0], [0.5, 0.0]])
    values = T([[0.2, 0.4], [0.1, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    expected = compute_gae_advantages(rewards, values, mask, 0.9, 0.8)
    got = adv.compute_advantages("ppo", rewards, values, mask, 1, 0.9, 0.8)
    close(got[0], expected[0]), close(got[1], expected[1])


def test_groups_must_tile_the_batch_and_unknown_names_list_the_valid_ones():
    rewards, mask = scores_at_end([1, 2, 3], [1, 1, 1])
    with pytest.raises(ValueError, match="groups of rollout.n=2"):
        adv.compute_grpo_outcome_advantages(rewards, mask, 2)
    with pytest.raises(ValueError, match="'ppo', 'grpo', 'rloo', 'reinforce_pp'"):
        adv.compute_advantages("a2c", rewards, rewards, mask)
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3', 'abs', 'low_var_kl'"):
        kl.token_kl(rewards, rewards, "k4")


def test_config_names_match_the_estimator_table():
    assert set(ALGORITHMS) == set(adv.ADVANTAGE_ESTIMATORS) | {"dpo"}
    # kl.estimator's choices are the one KL table's keys, and each placement's default is one of them.
    assert set(typing.get_args(KLEstimator)) == set(kl.KL_ESTIMATORS)
    assert set(DEFAULT_ESTIMATOR.values()) <= set(kl.KL_ESTIMATORS)
    assert set(DEFAULT_KL_IN_LOSS) == set(ALGORITHMS)


def test_the_kl_section_resolves_where_the_kl_goes_and_its_estimator():
    def objective(name, **kl_keys):
        sections = {
            "algorithm": AlgorithmConfig(name=name),
            "kl": KLConfig(**kl_keys),
            "sampling": SamplingConfig(temperature=0.7, max_new_tokens=9),
            "rollout": RolloutConfig(n=4),
            "reward": RewardConfig(),
            "ppo": PPOConfig(lam=0.9) if name == "ppo" else None,
        }
        return Objective.of(types.SimpleNamespace(**sections))

    grpo, ppo = objective("grpo"), objective("ppo")
    assert (grpo.kl_in_loss, grpo.kl_estimator, grpo.kl_loss_coef) == (True, "low_var_kl", 0.001)
    assert (ppo.kl_in_loss, ppo.kl_estimator) == (False, "k1")
    assert objective("ppo", in_loss=True, estimator="k2").kl_estimator == "k2"
    assert objective("grpo", in_loss=False).kl_estimator == "k1"
    assert objective("grpo", estimator="k3").kl_estimator == "k3"
    assert grpo.sampling == SamplingParams(0.7, 1.0, 9) and grpo.group_size == 4
    assert ppo.lam == 0.9 and grpo.lam == Objective().lam  # ppo.* only for PPO: GRPO has no GAE


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_methods_need_two_samples_per_prompt(tmp_path, name):
    from rlflow.engine.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  name: %s\n" % name)
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        load_config(path)
    assert load_config(path, ["rollout.n=2"]).algorithm.critic_free


def test_gae_steps_over_observation_tokens_as_if_they_were_removed():
    # A multi-turn row: model tokens, a 2-token tool result (mask 0), model tokens, padding.
    mask = T([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0]], dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)
    a, r = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.7)
    for row in range(2):
        keep = mask[row].bool()
        a_kept, r_kept = compute_gae_advantages(rewards[row, keep][None], values[row, keep][None],
                                                torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.7)
        assert torch.equal(a[row, keep], a_kept[0]) and torch.equal(r[row, keep], r_kept[0])
        assert torch.equal(a[row, ~keep], torch.zeros(int((~keep).sum())))
    # By hand, row 1's last two model tokens (positions 2 and 4): delta_4 = r4 - v4, A_4 = delta_4;
    # delta_2 = r2 + 0.9 v4 - v2, A_2 = delta_2 + 0.9 * 0.7 * A_4.
    a4 = rewards[1, 4] - values[1, 4]
    a2 = rewards[1, 2] + 0.9 * values[1, 4] - values[1, 2] + 0.63 * a4
    close(a[1, [2, 4]], torch.stack([a2, a4]))
