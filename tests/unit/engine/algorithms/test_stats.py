"""Tests for rlflow.engine.algorithms.stats against hand arithmetic or independent reference formulas."""

import math

import pytest
import torch

from rlflow.engine.algorithms import advantages, stats

T = torch.tensor


def close(actual, expected, atol=1e-5, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=rtol)


# Shared small example: rows of length 2 and 1 inside T=3.
X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_by_hand():
    close(stats.masked_sum(X, MASK), 7.0)  # 1 + 2 + 4
    close(stats.masked_sum(X, MASK, dim=-1), [3.0, 4.0])
    close(stats.masked_mean(X, MASK), 7.0 / 3.0)
    close(stats.masked_mean(X, MASK, dim=-1), [1.5, 4.0])
    close(stats.masked_mean(X, MASK.bool(), dim=0), [2.5, 2.0, 0.0])  # empty column -> 0


def test_masked_reductions_ignore_nonfinite_padding():
    x = X.clone()
    x[0, 2] = float("inf")
    x[1, 1] = float("nan")
    close(stats.masked_sum(x, MASK), 7.0)
    close(stats.masked_mean(x, MASK), 7.0 / 3.0)


def test_masked_var_by_hand_and_too_few_elements():
    x = T([1.0, 2.0, 3.0, 100.0])
    mask = T([1.0, 1.0, 1.0, 0.0])
    # mean 2; squared deviations 1 + 0 + 1 = 2; biased 2/3, unbiased 2/2 = 1
    close(stats.masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(stats.masked_var(x, mask, unbiased=True), 1.0)
    with pytest.raises(ValueError):
        stats.masked_var(x, T([1.0, 0.0, 0.0, 0.0]), unbiased=True)
    with pytest.raises(ValueError):
        stats.masked_var(x, torch.zeros(4), unbiased=False)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        stats.masked_sum(X, MASK[:, 0])


def test_masked_whiten_by_hand():
    x = T([[1.0, 2.0, 3.0, 50.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, unbiased var 1 -> (x - 2) / 1 ; padded position forced to 0
    close(stats.masked_whiten(x, mask, eps=0.0), [[-1.0, 0.0, 1.0, 0.0]])
    # shift_mean=False adds the mean back: [1, 2, 3]
    close(stats.masked_whiten(x, mask, shift_mean=False, eps=0.0), [[1.0, 2.0, 3.0, 0.0]])


def test_masked_whiten_statistics_on_random_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen) * 7.0 + 3.0
    mask = T([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).float()
    x[mask == 0] = 1e6  # padding must not leak into the statistics
    out = stats.masked_whiten(x, mask)
    close(stats.masked_mean(out, mask), 0.0)
    close(stats.masked_var(out, mask), 1.0, atol=1e-4)
    assert torch.all(out[mask == 0] == 0)
    kept_mean = stats.masked_whiten(x, mask, shift_mean=False)
    close(stats.masked_mean(kept_mean, mask), stats.masked_mean(x, mask), atol=1e-4)


# --------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    rewards = T([[0.0, 1.0, 5.0]])  # 5.0 sits on padding and must be ignored
    values = T([[0.5, 0.2, 9.0]])
    mask = T([[1.0, 1.0, 0.0]])
    adv, ret = advantages.compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
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
    adv, ret = advantages.compute_gae_advantages(rewards, values, mask, gamma=0.95, lam=0.7)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, 0.95, 0.7)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_lambda_one_gives_discounted_monte_carlo_return():
    rewards = T([[1.0, 2.0, 3.0, 0.0]])
    values = T([[0.3, -0.4, 2.0, 7.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    _, ret = advantages.compute_gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    # G2 = 3 ; G1 = 2 + 0.5*3 = 3.5 ; G0 = 1 + 0.5*3.5 = 2.75 (values cancel when lam=1)
    close(ret, [[2.75, 3.5, 3.0, 0.0]])


def test_gae_outputs_are_detached():
    values = torch.zeros(1, 2, requires_grad=True)
    adv, ret = advantages.compute_gae_advantages(torch.ones(1, 2), values, torch.ones(1, 2), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- logits, metrics


def test_entropy_from_logits_by_hand():
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    # uniform over 4: ln 4 ; p = [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(stats.entropy_from_logits(logits), [[math.log(4.0), 0.5623351]])


def test_entropy_handles_minus_inf_logits_with_finite_gradient():
    logits = T([[[0.0, 0.0, float("-inf")]]]).requires_grad_(True)
    entropy = stats.entropy_from_logits(logits)
    close(entropy, [[math.log(2.0)]])
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_logprobs_from_logits_by_hand_and_reference():
    logits = T([[[0.0, math.log(3.0)]]])
    close(stats.logprobs_from_logits(logits, T([[1]])), [[math.log(0.75)]])
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=gen)
    ids = torch.randint(0, 6, (2, 3), generator=gen)
    expected = torch.empty(2, 3)
    for b in range(2):
        for t in range(3):
            row = logits[b, t]
            expected[b, t] = row[ids[b, t]] - torch.log(row.exp().sum())
    close(stats.logprobs_from_logits(logits, ids), expected)
    low_precision = stats.logprobs_from_logits(logits.bfloat16(), ids)
    assert low_precision.dtype == torch.float32
    assert stats.entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_explained_variance_by_hand():
    returns = T([[1.0, 2.0, 3.0, 40.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # residual [0, 0, 1]: mean 1/3, var (1/9 + 1/9 + 4/9) / 3 = 2/9 ; Var(R) = 2/3 -> 1 - 1/3
    close(stats.explained_variance(T([[1.0, 2.0, 2.0, -5.0]]), returns, mask), 2.0 / 3.0)
    close(stats.explained_variance(T([[1.0, 2.0, 3.0, 0.0]]), returns, mask), 1.0)


def test_distinct_n_by_hand():
    texts = [["a", "b", "a", "b"], ["a", "b", "c"]]
    # bigrams: ab ba ab | ab bc -> 5 total, unique {ab, ba, bc} = 3
    assert stats.distinct_n(texts, n=2) == pytest.approx(3 / 5)
    # unigrams: 7 total, unique {a, b, c}
    assert stats.distinct_n(texts, n=1) == pytest.approx(3 / 7)
    assert stats.distinct_n([[1, 2], [1, 2]], n=2) == pytest.approx(1 / 2)
    assert stats.distinct_n([[1], []], n=2) == 0.0
    assert stats.distinct_n([], n=2) == 0.0


def test_mean_and_stderr_by_hand_and_one_value():
    mean, se = stats.mean_and_stderr([1.0, 2.0, 4.0, 5.0])  # var (4+1+1+4)/3
    assert mean == 3.0 and se == pytest.approx(math.sqrt(10 / 3 / 4))
    assert stats.mean_and_stderr([0.7]) == (0.7, 0.0)
    with pytest.raises(ValueError, match="no values"):
        stats.mean_and_stderr([])


def test_paired_difference_by_hand_and_smaller_than_unpaired_on_correlated_items():
    mean, se = stats.paired_difference([1, 0, 1, 1], [1, 1, 1, 0])  # differences 0, 1, 0, -1
    assert mean == 0.0 and se == pytest.approx(math.sqrt(2 / 3 / 4))
    # Items that differ a lot among themselves, each moved by about +0.1: pairing sees the move.
    g = torch.Generator().manual_seed(0)
    before = torch.rand(200, generator=g) * 10
    after = before + 0.1 + 0.05 * torch.randn(200, generator=g)
    mean, se = stats.paired_difference(before.tolist(), after.tolist())
    assert se == pytest.approx(float((after - before).std() / math.sqrt(200)), rel=1e-5)
    unpaired = math.hypot(stats.mean_and_stderr(before.tolist())[1], stats.mean_and_stderr(after.tolist())[1])
    assert mean / se > 15 > 1 > mean / unpaired
    with pytest.raises(ValueError, match="3 before, 2 after"):
        stats.paired_difference([1, 2, 3], [1, 2])


def test_sign_agreement_counts_only_items_both_scorers_tell_apart():
    # item: proxy change, judge change -> +1/+2 agree, +1/-1 disagree, 0/+1 and +2/0 not told apart, -1/-3 agree
    proxy_before, proxy_after = [0, 0, 0, 0, 1], [1, 1, 0, 2, 0]
    judge_before, judge_after = [0, 1, 0, 5, 3], [2, 0, 1, 5, 0]
    share, n = stats.sign_agreement(proxy_before, proxy_after, judge_before, judge_after)
    assert (share, n) == (pytest.approx(2 / 3), 3)
    assert stats.sign_agreement([1, 2], [1, 2], [0, 0], [1, 1]) == (None, 0)  # the proxy tells none apart
    with pytest.raises(ValueError, match=r"lengths \[2, 3\]"):
        stats.sign_agreement([1, 2], [1, 2], [0, 0], [1, 1, 1])
