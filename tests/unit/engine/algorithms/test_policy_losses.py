"""Tests for rlflow.engine.algorithms.policy_losses: PPO (symmetric and DAPO's decoupled clip),
GSPO and CISPO against hand arithmetic, and GSPO's token form against its sequence objective."""

import math

import pytest
import torch

from rlflow.engine.algorithms import policy_losses
from rlflow.engine.algorithms.losses import aggregate_loss

T = torch.tensor


def close(actual, expected, atol=1e-5, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=rtol)


def leaf(old, ratio):
    return (old + ratio.log()).requires_grad_(True)


def test_ppo_policy_loss_by_hand_all_branches():
    ratio = T([[1.5, 0.5, 1.5, 0.5, 1.0]])
    adv = T([[1.0, 1.0, -1.0, -1.0, 2.0]])
    old = T([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    logp = leaf(old, ratio)
    loss, clipped, approx_kl = policy_losses.ppo_policy_loss(logp, old, adv, torch.ones_like(adv), 0.2, 0.2)
    # A=+1 r=1.5: max(-1.5, -1.2) = -1.2 clipped | A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    # A=-1 r=1.5: max(1.5, 1.2) = 1.5            | A=-1 r=0.5: max(0.5, 0.8) = 0.8 clipped
    # A=2 r=1: both -2, equal -> not counted as clipped
    close(loss, [[-1.2, -0.5, 1.5, 0.8, -2.0]])
    close(clipped, [[1.0, 0.0, 0.0, 1.0, 0.0]])
    close(approx_kl, -ratio.log())  # old - new = -log r
    loss.sum().backward()
    # d(-A r)/dlogp = -A r on unclipped tokens, 0 where the clipped constant was taken
    close(logp.grad, [[0.0, -0.5, 1.5, 0.0, -2.0]])


def test_ppo_decoupled_clip_bounds_by_hand():
    # clip_low 0.2, clip_high 0.28 (DAPO): the ratio lives in [0.8, 1.28]
    ratio = T([[1.25, 1.3, 0.75, 0.85]])
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    old = torch.zeros(1, 4)
    logp = leaf(old, ratio)
    loss, clipped, _ = policy_losses.ppo_policy_loss(logp, old, adv, torch.ones_like(adv), 0.2, 0.28)
    # 1.25 < 1.28: unclipped -1.25 (symmetric 0.2 would have clipped it to -1.2) | 1.3: clipped -1.28
    # A=-1 r=0.75: max(0.75, 0.8) = 0.8 clipped | r=0.85: max(0.85, 0.85) inside, 0.85
    close(loss, [[-1.25, -1.28, 0.8, 0.85]])
    close(clipped, [[0.0, 1.0, 1.0, 0.0]])
    symmetric, _, _ = policy_losses.ppo_policy_loss(logp, old, adv, torch.ones_like(adv), 0.2, 0.2)
    close(symmetric[0, 0], -1.2)


def test_ppo_policy_loss_finite_for_extreme_ratio():
    loss, _, _ = policy_losses.ppo_policy_loss(T([[0.0]]), T([[-1e4]]), T([[0.0]]), T([[1.0]]), 0.2, 0.2)
    assert torch.isfinite(loss).all()  # without the clamp: 0 * exp(1e4) = 0 * inf = nan


def test_gspo_sequence_ratio_and_whole_row_clipping_by_hand():
    # row 0: token ratios 1.1 and 1.3 (third token padding): s = exp(mean log r) = sqrt(1.43)
    # row 1: one token, ratio 1.5 > 1.2: the row is clipped
    old = T([[-1.0, -2.0, -0.3], [-0.5, -1.0, -1.0]])
    ratio = T([[1.1, 1.3, 9.0], [1.5, 1.0, 1.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = T([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    logp = leaf(old, ratio)
    loss, clipped, approx_kl = policy_losses.gspo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
    s = math.sqrt(1.1 * 1.3)  # 1.19583 < 1.2
    close(loss[0, :2], [-s, -s])
    close(loss[1, 0], -1.2)
    close(clipped * mask, [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    close(approx_kl, -ratio.log())
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    # row 0 (weight 1/2 rows x 1/2 tokens): d(-s)/dlogp_t = -s / 2 each; row 1 clipped: 0; padding: 0
    close(logp.grad, [[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(4, 6, generator=gen) * 3
    logp = (old + torch.randn(4, 6, generator=gen) * 0.1).requires_grad_(True)
    mask = T([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]).float()
    adv = T([1.5, -0.7, 0.3, -2.0])
    token_loss, _, _ = policy_losses.gspo_policy_loss(logp, old, adv[:, None].expand(4, 6), mask, 0.05, 0.08)
    aggregate_loss(token_loss, mask, "seq-mean-token-mean").backward()
    token_grad = logp.grad.clone()
    # GSPO's objective written directly on sequences: -mean_i min(s_i A_i, clip(s_i) A_i)
    logp.grad = None
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    objective = torch.minimum(s * adv, s.clamp(1 - 0.05, 1 + 0.08) * adv)
    (-objective.mean()).backward()
    close(token_grad, logp.grad, atol=1e-6)
    assert (token_grad != 0).any() and (token_grad * (1 - mask) == 0).all()


def test_gspo_row_without_tokens_is_finite():
    loss, clipped, _ = policy_losses.gspo_policy_loss(T([[-1.0]]), T([[-2.0]]), T([[1.0]]), T([[0.0]]), 0.2, 0.2)
    close(loss, [[-1.0]])  # s = 1 (empty mean 0), nothing to clip
    close(clipped, [[0.0]])


def test_cispo_keeps_the_gradient_of_clipped_tokens_by_hand():
    ratio = T([[1.5, 1.0, 0.5]])
    adv = T([[1.0, 2.0, -1.0]])
    old = T([[-1.0, -2.0, -0.5]])
    logp = leaf(old, ratio)
    loss, clipped, _ = policy_losses.cispo_policy_loss(logp, old, adv, torch.ones_like(adv), 0.2, 0.2)
    # weights sg(clip(r)): 1.2, 1.0, 0.8; loss = -w A logp
    close(loss, [[-1.2 * 1.0 * logp[0, 0].item(), -1.0 * 2.0 * logp[0, 1].item(), 0.8 * logp[0, 2].item()]])
    close(clipped, [[1.0, 0.0, 1.0]])
    loss.sum().backward()
    close(logp.grad, [[-1.2, -2.0, 0.8]])  # PPO would give 0 on the first and the last
    # inside the bounds CISPO's gradient is PPO's (-A r)
    ppo_logp = leaf(old, ratio)
    ppo, _, _ = policy_losses.ppo_policy_loss(ppo_logp, old, adv, torch.ones_like(adv), 0.2, 0.2)
    ppo.sum().backward()
    close(logp.grad[0, 1], ppo_logp.grad[0, 1])
    close(ppo_logp.grad[0, 0], 0.0)


def test_every_loss_is_zero_where_the_advantage_is_zero_and_names_are_checked():
    old = T([[-1.0, -2.0]])
    logp = (old + 0.3).requires_grad_(True)
    for name, loss_fn in policy_losses.POLICY_LOSSES.items():
        loss, _, _ = loss_fn(logp, old, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.2)
        assert torch.equal(loss.detach().abs(), torch.zeros(1, 2)), name
        assert policy_losses.policy_loss(name) is loss_fn
    with pytest.raises(ValueError) as info:
        policy_losses.policy_loss("grpo")
    assert "'ppo', 'gspo', 'cispo'" in str(info.value)


def test_the_config_names_the_same_losses():
    from rlflow.engine.config.methods import POLICY_LOSSES

    assert POLICY_LOSSES == tuple(policy_losses.POLICY_LOSSES)
