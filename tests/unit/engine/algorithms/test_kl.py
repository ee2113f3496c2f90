"""Tests for rlflow.engine.algorithms.kl: the per-token KL estimators, the penalised token rewards and
the KL-coefficient controllers, against hand arithmetic or exact KL of a discrete distribution."""

import json
import math

import pytest
import torch

from rlflow.engine.algorithms import kl

T = torch.tensor


def close(actual, expected, atol=1e-5, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=rtol)


def test_kl_penalty_kinds_by_hand():
    logp = T([[-1.0, -2.0]])
    ref = T([[-1.5, -1.0]])
    # logp - ref = [0.5, -1.0]
    close(kl.token_kl(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl.token_kl(logp, ref, "k2"), [[0.125, 0.5]])
    close(kl.token_kl(logp, ref, "abs"), [[0.5, 1.0]])
    # ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1 ; exp(1) - 1 - 1
    close(kl.token_kl(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2.0]])


def test_k1_and_k3_are_unbiased_for_exact_kl():
    # E_{x~p}[k] over a full discrete distribution must equal KL(p || q) = sum p log(p/q).
    gen = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    logq = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    exact_kl = (logp.exp() * (logp - logq)).sum()
    for kind in ("k1", "k3"):
        per_token = kl.token_kl(logp[None], logq[None], kind)[0]
        close((logp.exp() * per_token).sum(), exact_kl)


def test_k3_does_not_overflow_on_huge_log_ratio():
    logp = T([[0.0, -1e4]])
    ref = T([[-1e4, 0.0]])
    k3 = kl.token_kl(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    # ref - logp clamped to -20 and +20 respectively
    close(k3, [[math.exp(-20.0) + 20.0 - 1.0, math.exp(20.0) - 21.0]], rtol=1e-6)


def test_unknown_kl_kind_lists_valid_kinds():
    with pytest.raises(ValueError) as info:
        kl.token_kl(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    for kind in ("k1", "k2", "k3", "abs"):
        assert repr(kind) in str(info.value)


def test_compute_token_rewards_by_hand():
    scores = T([2.0, -1.0])
    per_token_kl = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = kl.compute_token_rewards(scores, per_token_kl, mask, kl_coef=0.5)
    # row 0: [-0.05, -0.1 + 2, 0 (padding)] ; row 1: [-0.2, -0.25, -0.3 - 1]
    close(rewards, [[-0.05, 1.9, 0.0], [-0.2, -0.25, -1.3]])


def test_a_multi_turn_row_gets_its_score_on_its_last_model_token():
    # model, observation, observation, model, padding: the score lands on position 3, not at sum(mask) - 1
    mask = T([[1.0, 0.0, 0.0, 1.0, 0.0]])
    rewards = kl.compute_token_rewards(T([3.0]), torch.full((1, 5), 0.2), mask, kl_coef=0.5)
    close(rewards, [[-0.1, 0.0, 0.0, 2.9, 0.0]])


def test_compute_token_rewards_rejects_empty_row_and_bad_scores():
    with pytest.raises(ValueError):
        kl.compute_token_rewards(T([1.0]), torch.zeros(1, 2), torch.zeros(1, 2), 0.1)
    with pytest.raises(ValueError):
        kl.compute_token_rewards(T([[1.0]]), torch.zeros(1, 2), torch.ones(1, 2), 0.1)


def test_adaptive_kl_controller_by_hand():
    ctl = kl.AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)
    # e = 9/6 - 1 = 0.5 -> clipped to 0.2 ; coef = 0.2 * (1 + 0.2 * 0.1) = 0.204
    assert ctl.value == pytest.approx(0.204)
    ctl.update(current_kl=5.4, n_steps=500)
    # e = 0.9 - 1 = -0.1 ; coef = 0.204 * (1 - 0.1 * 0.05) = 0.20298
    assert ctl.value == pytest.approx(0.20298)
    with pytest.raises(ValueError):
        ctl.update(current_kl=float("nan"), n_steps=1)


def test_fixed_kl_controller_and_state_roundtrip():
    fixed = kl.FixedKLController(0.1)
    fixed.update(current_kl=100.0, n_steps=10**6)
    assert fixed.value == 0.1
    adaptive = kl.AdaptiveKLController(0.2, target=6.0, horizon=10000)
    adaptive.update(9.0, 1000)
    state = json.loads(json.dumps(adaptive.state_dict()))
    restored = kl.AdaptiveKLController(0.5, target=6.0, horizon=10000)
    restored.load_state_dict(state)
    assert restored.value == adaptive.value == pytest.approx(0.204)
    fixed.load_state_dict(json.loads(json.dumps({"value": 0.3})))
    assert fixed.value == 0.3


def test_make_kl_controller_dispatch_and_unknown_kind():
    assert isinstance(kl.make_kl_controller("fixed", 0.1, 6.0, 10000), kl.FixedKLController)
    adaptive = kl.make_kl_controller("adaptive", 0.1, 6.0, 10000)
    assert isinstance(adaptive, kl.AdaptiveKLController)
    assert adaptive.target == 6.0 and adaptive.horizon == 10000
    with pytest.raises(ValueError) as info:
        kl.make_kl_controller("pid", 0.1, 6.0, 10000)
    assert "'fixed'" in str(info.value) and "'adaptive'" in str(info.value)


def test_kl_losses_by_hand_and_bounded():
    logp = T([[-1.0, -2.0]])
    ref = T([[-1.5, -1.0]])
    d = logp - ref  # log(pi / ref) = 0.5, -1.0
    close(kl.token_kl(logp, ref, "k1"), d)
    close(kl.token_kl(logp, ref, "k2"), 0.5 * d**2)
    k3 = torch.exp(-d) - (-d) - 1
    close(kl.token_kl(logp, ref, "k3"), k3)
    close(kl.token_kl(logp, ref, "low_var_kl"), k3)
    huge = kl.token_kl(T([[-200.0]]), T([[0.0]]), "low_var_kl")  # ratio e^200: finite and bounded
    assert torch.isfinite(huge).all() and float(huge) == kl.LOW_VAR_KL_BOUND
    assert torch.isfinite(kl.token_kl(T([[-200.0]]), T([[0.0]]), "k3")).all()


def test_k2_gradient_is_the_log_ratio_and_reference_gets_none():
    logp = T([[-1.0, -2.0]], requires_grad=True)
    ref = T([[-1.5, -1.0]], requires_grad=True)
    kl.token_kl(logp, ref, "k2").sum().backward()
    close(logp.grad, T([[0.5, -1.0]]))
    assert ref.grad is None


def test_behaviour_weighted_kl_by_hand_and_unbiased_over_the_samplers_distribution():
    old, ref, behaviour = torch.tensor([[-1.0, -5.0]]), torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -2.0]])
    out = kl.behaviour_weighted_kl(old, ref, behaviour)
    # token 2: k3 = e^4 - 4 - 1 = 49.598..., weighed by pi/pi_behaviour = e^-3
    assert out[0].tolist() == pytest.approx([0.0, (math.exp(4) - 5) * math.exp(-3)], rel=1e-6)
    # Summed over every token the sampler can draw, weighted by its probability, it is KL(pi || ref)
    # exactly, whatever the sampler; plain k3 under the sampler's draws is not.
    generator = torch.Generator().manual_seed(0)
    pi, ref_p, sampler = (torch.softmax(torch.randn(6, generator=generator) * 2, 0) for _ in range(3))
    weighted = kl.behaviour_weighted_kl(pi.log()[None], ref_p.log()[None], sampler.log()[None])[0]
    exact = float((pi * (pi.log() - ref_p.log())).sum())
    assert float((sampler * weighted).sum()) == pytest.approx(exact, rel=1e-5)
    plain = kl.token_kl(pi.log()[None], ref_p.log()[None], "k3")[0]
    assert abs(float((sampler * plain).sum()) - exact) > 1e-2
