"""The DPO loss (engine/algorithms/dpo_loss.py) by hand: the loss and its implicit rewards, label
smoothing, beta, the policy equal to its reference, the gradient's direction, and the chosen NLL."""

import math

import pytest
import torch

from rlflow.engine.algorithms.dpo_loss import chosen_nll, dpo_loss

LOG2 = math.log(2.0)


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_dpo_loss_by_hand():
    # h = (pi_c - pi_r) - (ref_c - ref_r): pair 0: (-10 + 12) - 0 = 2; pair 1: (-5 + 4) - (-5 + 5) = -1;
    # pair 2: (-3 + 3) - (-4 + 2) = 2. beta = 0.1: beta*h = 0.2, -0.1, 0.2.
    loss, chosen, rejected = dpo_loss(t(-10, -5, -3), t(-12, -4, -3), t(-11, -5, -4), t(-11, -5, -2), 0.1, 0.0)
    # -log sigmoid(x) = log(1 + e^-x): x = 0.2 -> 0.598138869, x = -0.1 -> 0.744396660
    assert torch.allclose(loss, t(0.598138869, 0.744396660, 0.598138869), atol=1e-6)
    assert torch.allclose(chosen, t(0.1, 0.0, 0.1), atol=1e-6)  # beta * (pi_c - ref_c)
    assert torch.allclose(rejected, t(-0.1, 0.1, -0.1), atol=1e-6)  # beta * (pi_r - ref_r)


def test_dpo_loss_label_smoothing_by_hand():
    # eps = 0.1, beta*h = 0.2: 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.9*0.598138869 + 0.1*0.798138869
    loss, _, _ = dpo_loss(t(-10), t(-12), t(-11), t(-11), 0.1, 0.1)
    assert loss.item() == pytest.approx(0.618138869, abs=1e-6)
    # A wrong-way pair (beta*h = -0.2) costs less with smoothing than without: it may be a flipped label.
    smooth, _, _ = dpo_loss(t(-12), t(-10), t(-11), t(-11), 0.1, 0.1)
    plain, _, _ = dpo_loss(t(-12), t(-10), t(-11), t(-11), 0.1, 0.0)
    assert plain.item() == pytest.approx(0.798138869, abs=1e-6)
    assert smooth.item() == pytest.approx(0.9 * 0.798138869 + 0.1 * 0.598138869, abs=1e-6)


def test_dpo_loss_beta_scales_the_log_ratios():
    pc, pr, rc, rr = t(-10, -7), t(-12, -6), t(-11, -8), t(-11, -5)
    loss_b2, chosen_b2, rejected_b2 = dpo_loss(pc, pr, rc, rr, 2.0, 0.05)
    loss_b1, chosen_b1, rejected_b1 = dpo_loss(2 * pc, 2 * pr, 2 * rc, 2 * rr, 1.0, 0.05)
    assert torch.allclose(loss_b2, loss_b1, atol=1e-6)
    assert torch.allclose(chosen_b2, 2 * (pc - rc)) and torch.allclose(rejected_b2, 2 * (pr - rr))


def test_policy_equal_to_reference_gives_log2_and_zero_rewards():
    logps_c, logps_r = t(-20.5, -3.0, -7.25), t(-1.0, -30.0, -7.25)
    for eps in (0.0, 0.2):
        loss, chosen, rejected = dpo_loss(logps_c, logps_r, logps_c, logps_r, 0.5, eps)
        assert torch.allclose(loss, torch.full((3,), LOG2), atol=1e-6)
        assert torch.equal(chosen, torch.zeros(3)) and torch.equal(rejected, torch.zeros(3))


def test_gradient_pushes_chosen_up_and_rejected_down():
    policy_c, policy_r = t(-10, -4).requires_grad_(), t(-12, -3).requires_grad_()
    loss, chosen, _ = dpo_loss(policy_c, policy_r, t(-11, -4), t(-11, -4), 0.1, 0.0)
    loss.sum().backward()
    assert (policy_c.grad < 0).all() and (policy_r.grad > 0).all()  # descent raises chosen, lowers rejected
    # d loss / d pi_c = -beta * sigmoid(-beta * h): pair 0 has h = 2 (-0.1 * sigmoid(-0.2) = -0.0450166),
    # pair 1 (a wrong-way pair) h = -1 (-0.1 * sigmoid(0.1) = -0.0524979): the worse pair pulls harder
    assert torch.allclose(policy_c.grad, t(-0.0450166, -0.0524979), atol=1e-7)
    assert torch.allclose(policy_r.grad, -policy_c.grad)
    assert not chosen.requires_grad  # rewards are for logging only


def test_chosen_nll_is_the_per_token_mean_by_hand():
    # -(-12) / 4 = 3; -(-5) / 1 = 5; a zero token count is taken as one token.
    assert torch.allclose(chosen_nll(t(-12, -5, -2), torch.tensor([4, 1, 0])), t(3.0, 5.0, 2.0))
