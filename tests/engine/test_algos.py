"""Tests for rlflow.engine.algos against hand arithmetic or independent reference formulas."""

import json
import math

import pytest
import torch

from rlflow.engine import algos

T = torch.tensor


def close(actual, expected, atol=1e-5, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=rtol)


# Shared small example: rows of length 2 and 1 inside T=3.
X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_by_hand():
    close(algos.masked_sum(X, MASK), 7.0)  # 1 + 2 + 4
    close(algos.masked_sum(X, MASK, dim=-1), [3.0, 4.0])
    close(algos.masked_mean(X, MASK), 7.0 / 3.0)
    close(algos.masked_mean(X, MASK, dim=-1), [1.5, 4.0])
    close(algos.masked_mean(X, MASK.bool(), dim=0), [2.5, 2.0, 0.0])  # empty column -> 0


def test_masked_reductions_ignore_nonfinite_padding():
    x = X.clone()
    x[0, 2] = float("inf")
    x[1, 1] = float("nan")
    close(algos.masked_sum(x, MASK), 7.0)
    close(algos.masked_mean(x, MASK), 7.0 / 3.0)


def test_masked_var_by_hand_and_too_few_elements():
    x = T([1.0, 2.0, 3.0, 100.0])
    mask = T([1.0, 1.0, 1.0, 0.0])
    # mean 2; squared deviations 1 + 0 + 1 = 2; biased 2/3, unbiased 2/2 = 1
    close(algos.masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(algos.masked_var(x, mask, unbiased=True), 1.0)
    with pytest.raises(ValueError):
        algos.masked_var(x, T([1.0, 0.0, 0.0, 0.0]), unbiased=True)
    with pytest.raises(ValueError):
        algos.masked_var(x, torch.zeros(4), unbiased=False)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        algos.masked_sum(X, MASK[:, 0])


def test_masked_whiten_by_hand():
    x = T([[1.0, 2.0, 3.0, 50.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, unbiased var 1 -> (x - 2) / 1 ; padded position forced to 0
    close(algos.masked_whiten(x, mask, eps=0.0), [[-1.0, 0.0, 1.0, 0.0]])
    # shift_mean=False adds the mean back: [1, 2, 3]
    close(algos.masked_whiten(x, mask, shift_mean=False, eps=0.0), [[1.0, 2.0, 3.0, 0.0]])


def test_masked_whiten_statistics_on_random_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen) * 7.0 + 3.0
    mask = T([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).float()
    x[mask == 0] = 1e6  # padding must not leak into the statistics
    out = algos.masked_whiten(x, mask)
    close(algos.masked_mean(out, mask), 0.0)
    close(algos.masked_var(out, mask), 1.0, atol=1e-4)
    assert torch.all(out[mask == 0] == 0)
    kept_mean = algos.masked_whiten(x, mask, shift_mean=False)
    close(algos.masked_mean(kept_mean, mask), algos.masked_mean(x, mask), atol=1e-4)


# --------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    rewards = T([[0.0, 1.0, 5.0]])  # 5.0 sits on padding and must be ignored
    values = T([[0.5, 0.2, 9.0]])
    mask = T([[1.0, 1.0, 0.0]])
    adv, ret = algos.compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=1 (last real): delta = 1 + 0 (bootstrap 0) - 0.2 = 0.8 ; A1 = 0.8
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32 ; A0 = -0.32 + 0.9*0.8*0.8 = 0.256
    close(adv, [[0.256, 0.8, 0.0]])
    close(ret, [[0.756, 1.0, 0.0]])  # A + V, 0 on padding


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain per-row python loop written from the GAE definition."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        length = int(mask[b].sum())
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[b, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv, (adv + values) * mask


def test_gae_matches_python_loop_reference():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=gen)
    values = torch.randn(4, 6, generator=gen)
    lengths = [6, 3, 1, 4]
    mask = T([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    adv, ret = algos.compute_gae_advantages(rewards, values, mask, gamma=0.95, lam=0.7)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, 0.95, 0.7)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_lambda_one_gives_discounted_monte_carlo_return():
    rewards = T([[1.0, 2.0, 3.0, 0.0]])
    values = T([[0.3, -0.4, 2.0, 7.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    _, ret = algos.compute_gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    # G2 = 3 ; G1 = 2 + 0.5*3 = 3.5 ; G0 = 1 + 0.5*3.5 = 2.75 (values cancel when lam=1)
    close(ret, [[2.75, 3.5, 3.0, 0.0]])


def test_gae_outputs_are_detached():
    values = torch.zeros(1, 2, requires_grad=True)
    adv, ret = algos.compute_gae_advantages(torch.ones(1, 2), values, torch.ones(1, 2), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- KL


def test_kl_penalty_kinds_by_hand():
    logp = T([[-1.0, -2.0]])
    ref = T([[-1.5, -1.0]])
    # logp - ref = [0.5, -1.0]
    close(algos.kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    close(algos.kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])
    close(algos.kl_penalty(logp, ref, "abs"), [[0.5, 1.0]])
    # ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1 ; exp(1) - 1 - 1
    close(algos.kl_penalty(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2.0]])


def test_k1_and_k3_are_unbiased_for_exact_kl():
    # E_{x~p}[k] over a full discrete distribution must equal KL(p || q) = sum p log(p/q).
    gen = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    logq = torch.log_softmax(torch.randn(7, generator=gen), dim=0)
    exact_kl = (logp.exp() * (logp - logq)).sum()
    for kind in ("k1", "k3"):
        per_token = algos.kl_penalty(logp[None], logq[None], kind)[0]
        close((logp.exp() * per_token).sum(), exact_kl)


def test_k3_does_not_overflow_on_huge_log_ratio():
    logp = T([[0.0, -1e4]])
    ref = T([[-1e4, 0.0]])
    k3 = algos.kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    # ref - logp clamped to -20 and +20 respectively
    close(k3, [[math.exp(-20.0) + 20.0 - 1.0, math.exp(20.0) - 21.0]], rtol=1e-6)


def test_unknown_kl_kind_lists_valid_kinds():
    with pytest.raises(ValueError) as info:
        algos.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    for kind in ("k1", "k2", "k3", "abs"):
        assert repr(kind) in str(info.value)


def test_compute_token_rewards_by_hand():
    scores = T([2.0, -1.0])
    kl = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = algos.compute_token_rewards(scores, kl, mask, kl_coef=0.5)
    # row 0: [-0.05, -0.1 + 2, 0 (padding)] ; row 1: [-0.2, -0.25, -0.3 - 1]
    close(rewards, [[-0.05, 1.9, 0.0], [-0.2, -0.25, -1.3]])


def test_compute_token_rewards_rejects_empty_row_and_bad_scores():
    with pytest.raises(ValueError):
        algos.compute_token_rewards(T([1.0]), torch.zeros(1, 2), torch.zeros(1, 2), 0.1)
    with pytest.raises(ValueError):
        algos.compute_token_rewards(T([[1.0]]), torch.zeros(1, 2), torch.ones(1, 2), 0.1)


# --------------------------------------------------------------------------- PPO losses


def test_ppo_policy_loss_by_hand_all_branches():
    ratio = T([[1.5, 0.5, 1.5, 0.5, 1.0]])
    adv = T([[1.0, 1.0, -1.0, -1.0, 2.0]])
    old = T([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    loss, clipped, approx_kl = algos.ppo_policy_loss(logp, old, adv, clip_ratio=0.2)
    # A=+1 r=1.5: max(-1.5, -1.2) = -1.2 clipped | A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    # A=-1 r=1.5: max(1.5, 1.2) = 1.5            | A=-1 r=0.5: max(0.5, 0.8) = 0.8 clipped
    # A=2 r=1: both -2, equal -> not counted as clipped
    close(loss, [[-1.2, -0.5, 1.5, 0.8, -2.0]])
    close(clipped, [[1.0, 0.0, 0.0, 1.0, 0.0]])
    close(approx_kl, -ratio.log())  # old - new = -log r
    loss.sum().backward()
    # d(-A r)/dlogp = -A r on unclipped tokens, 0 where the clipped constant was taken
    close(logp.grad, [[0.0, -0.5, 1.5, 0.0, -2.0]])


def test_ppo_policy_loss_finite_for_extreme_ratio():
    loss, _, _ = algos.ppo_policy_loss(T([[0.0]]), T([[-1e4]]), T([[0.0]]), 0.2)
    assert torch.isfinite(loss).all()  # without the clamp: 0 * exp(1e4) = 0 * inf = nan


def test_value_loss_by_hand():
    values = T([[1.0, 1.0, 0.6, 0.0]])
    old = T([[0.5, 0.5, 0.5, 0.5]])
    returns = T([[1.0, 0.0, 2.0, 0.0]])
    loss, clipped = algos.value_loss(values, old, returns, clip_range=0.2)
    # v clipped to [0.3, 0.7]: [0.7, 0.7, 0.6, 0.3]
    # tok0: max(0, 0.09) -> 0.045 clipped | tok1: max(1, 0.49) -> 0.5
    # tok2: equal 1.96 -> 0.98            | tok3: max(0, 0.09) -> 0.045 clipped
    close(loss, [[0.045, 0.5, 0.98, 0.045]])
    close(clipped, [[1.0, 0.0, 0.0, 1.0]])


# --------------------------------------------------------------------------- aggregation


def test_aggregate_loss_modes_by_hand():
    # masked tokens: row0 {1, 2}, row1 {4}
    close(algos.aggregate_loss(X, MASK, "token-mean"), 7.0 / 3.0)
    close(algos.aggregate_loss(X, MASK, "token-mean", num_tokens=10), 0.7)
    close(algos.aggregate_loss(X, MASK, "seq-mean-token-sum"), (3.0 + 4.0) / 2.0)
    close(algos.aggregate_loss(X, MASK, "seq-mean-token-mean"), (1.5 + 4.0) / 2.0)


def test_token_mean_with_global_count_matches_full_batch():
    gen = torch.Generator().manual_seed(3)
    per_token = torch.randn(4, 5, generator=gen)
    mask = T([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).float()
    full = algos.aggregate_loss(per_token, mask, "token-mean")
    global_count = mask.sum()
    micro = [
        algos.aggregate_loss(per_token[i : i + 2], mask[i : i + 2], "token-mean", num_tokens=global_count)
        for i in (0, 2)
    ]
    close(micro[0] + micro[1], full)
    # the naive mean of per-micro-batch means differs here (6 vs 5 tokens), so the check bites
    naive = sum(algos.aggregate_loss(per_token[i : i + 2], mask[i : i + 2], "token-mean") for i in (0, 2)) / 2
    assert not torch.isclose(naive, full)


def test_aggregate_loss_rejects_unknown_mode_and_misplaced_num_tokens():
    with pytest.raises(ValueError) as info:
        algos.aggregate_loss(X, MASK, "sum")
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert repr(mode) in str(info.value)
    with pytest.raises(ValueError):
        algos.aggregate_loss(X, MASK, "seq-mean-token-mean", num_tokens=3)
    with pytest.raises(ValueError):
        algos.aggregate_loss(X, MASK, "token-mean", num_tokens=0)


# --------------------------------------------------------------------------- logits, metrics


def test_entropy_from_logits_by_hand():
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    # uniform over 4: ln 4 ; p = [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(algos.entropy_from_logits(logits), [[math.log(4.0), 0.5623351]])


def test_entropy_handles_minus_inf_logits_with_finite_gradient():
    logits = T([[[0.0, 0.0, float("-inf")]]]).requires_grad_(True)
    entropy = algos.entropy_from_logits(logits)
    close(entropy, [[math.log(2.0)]])
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_logprobs_from_logits_by_hand_and_reference():
    logits = T([[[0.0, math.log(3.0)]]])
    close(algos.logprobs_from_logits(logits, T([[1]])), [[math.log(0.75)]])
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=gen)
    ids = torch.randint(0, 6, (2, 3), generator=gen)
    expected = torch.empty(2, 3)
    for b in range(2):
        for t in range(3):
            row = logits[b, t]
            expected[b, t] = row[ids[b, t]] - torch.log(row.exp().sum())
    close(algos.logprobs_from_logits(logits, ids), expected)
    low_precision = algos.logprobs_from_logits(logits.bfloat16(), ids)
    assert low_precision.dtype == torch.float32
    assert algos.entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_explained_variance_by_hand():
    returns = T([[1.0, 2.0, 3.0, 40.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # residual [0, 0, 1]: mean 1/3, var (1/9 + 1/9 + 4/9) / 3 = 2/9 ; Var(R) = 2/3 -> 1 - 1/3
    close(algos.explained_variance(T([[1.0, 2.0, 2.0, -5.0]]), returns, mask), 2.0 / 3.0)
    close(algos.explained_variance(T([[1.0, 2.0, 3.0, 0.0]]), returns, mask), 1.0)


def test_distinct_n_by_hand():
    texts = [["a", "b", "a", "b"], ["a", "b", "c"]]
    # bigrams: ab ba ab | ab bc -> 5 total, unique {ab, ba, bc} = 3
    assert algos.distinct_n(texts, n=2) == pytest.approx(3 / 5)
    # unigrams: 7 total, unique {a, b, c}
    assert algos.distinct_n(texts, n=1) == pytest.approx(3 / 7)
    assert algos.distinct_n([[1, 2], [1, 2]], n=2) == pytest.approx(1 / 2)
    assert algos.distinct_n([[1], []], n=2) == 0.0
    assert algos.distinct_n([], n=2) == 0.0


# --------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_by_hand():
    ctl = algos.AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)
    # e = 9/6 - 1 = 0.5 -> clipped to 0.2 ; coef = 0.2 * (1 + 0.2 * 0.1) = 0.204
    assert ctl.value == pytest.approx(0.204)
    ctl.update(current_kl=5.4, n_steps=500)
    # e = 0.9 - 1 = -0.1 ; coef = 0.204 * (1 - 0.1 * 0.05) = 0.20298
    assert ctl.value == pytest.approx(0.20298)
    with pytest.raises(ValueError):
        ctl.update(current_kl=float("nan"), n_steps=1)


def test_fixed_kl_controller_and_state_roundtrip():
    fixed = algos.FixedKLController(0.1)
    fixed.update(current_kl=100.0, n_steps=10**6)
    assert fixed.value == 0.1
    adaptive = algos.AdaptiveKLController(0.2, target=6.0, horizon=10000)
    adaptive.update(9.0, 1000)
    state = json.loads(json.dumps(adaptive.state_dict()))
    restored = algos.AdaptiveKLController(0.5, target=6.0, horizon=10000)
    restored.load_state_dict(state)
    assert restored.value == adaptive.value == pytest.approx(0.204)
    fixed.load_state_dict(json.loads(json.dumps({"value": 0.3})))
    assert fixed.value == 0.3


def test_make_kl_controller_dispatch_and_unknown_kind():
    assert isinstance(algos.make_kl_controller("fixed", 0.1, 6.0, 10000), algos.FixedKLController)
    adaptive = algos.make_kl_controller("adaptive", 0.1, 6.0, 10000)
    assert isinstance(adaptive, algos.AdaptiveKLController)
    assert adaptive.target == 6.0 and adaptive.horizon == 10000
    with pytest.raises(ValueError) as info:
        algos.make_kl_controller("pid", 0.1, 6.0, 10000)
    assert "'fixed'" in str(info.value) and "'adaptive'" in str(info.value)
