"""Tests for rlflow.engine.algorithms.losses: the clipped value loss and the loss aggregation
modes, against hand arithmetic (the policy losses: test_policy_losses.py)."""

import pytest
import torch

from rlflow.engine.algorithms import losses

T = torch.tensor


def close(actual, expected, atol=1e-5, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=rtol)


# Shared small example: rows of length 2 and 1 inside T=3.
X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_value_loss_by_hand():
    values = T([[1.0, 1.0, 0.6, 0.0]])
    old = T([[0.5, 0.5, 0.5, 0.5]])
    returns = T([[1.0, 0.0, 2.0, 0.0]])
    loss, clipped = losses.value_loss(values, old, returns, clip_range=0.2)
    # v clipped to [0.3, 0.7]: [0.7, 0.7, 0.6, 0.3]
    # tok0: max(0, 0.09) -> 0.045 clipped | tok1: max(1, 0.49) -> 0.5
    # tok2: equal 1.96 -> 0.98            | tok3: max(0, 0.09) -> 0.045 clipped
    close(loss, [[0.045, 0.5, 0.98, 0.045]])
    close(clipped, [[1.0, 0.0, 0.0, 1.0]])


def test_aggregate_loss_modes_by_hand():
    # masked tokens: row0 {1, 2}, row1 {4}
    close(losses.aggregate_loss(X, MASK, "token-mean"), 7.0 / 3.0)
    close(losses.aggregate_loss(X, MASK, "token-mean", num_tokens=10), 0.7)
    close(losses.aggregate_loss(X, MASK, "seq-mean-token-sum"), (3.0 + 4.0) / 2.0)
    close(losses.aggregate_loss(X, MASK, "seq-mean-token-mean"), (1.5 + 4.0) / 2.0)
    # Dr. GRPO: row sums over a constant length 5, then the mean over rows
    close(losses.aggregate_loss(X, MASK, "seq-mean-token-sum-norm", norm_length=5), (3.0 / 5 + 4.0 / 5) / 2.0)


def test_token_mean_with_global_count_matches_full_batch():
    gen = torch.Generator().manual_seed(3)
    per_token = torch.randn(4, 5, generator=gen)
    mask = T([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).float()
    full = losses.aggregate_loss(per_token, mask, "token-mean")
    global_count = mask.sum()
    micro = [
        losses.aggregate_loss(per_token[i : i + 2], mask[i : i + 2], "token-mean", num_tokens=global_count)
        for i in (0, 2)
    ]
    close(micro[0] + micro[1], full)
    # the naive mean of per-micro-batch means differs here (6 vs 5 tokens), so the check bites
    naive = sum(losses.aggregate_loss(per_token[i : i + 2], mask[i : i + 2], "token-mean") for i in (0, 2)) / 2
    assert not torch.isclose(naive, full)


def test_aggregate_loss_rejects_unknown_mode_and_misplaced_num_tokens():
    with pytest.raises(ValueError) as info:
        losses.aggregate_loss(X, MASK, "sum")
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert repr(mode) in str(info.value)
    with pytest.raises(ValueError):
        losses.aggregate_loss(X, MASK, "seq-mean-token-mean", num_tokens=3)
    with pytest.raises(ValueError):
        losses.aggregate_loss(X, MASK, "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match="norm_length"):
        losses.aggregate_loss(X, MASK, "seq-mean-token-sum-norm")  # the constant is required
    with pytest.raises(ValueError, match="norm_length"):
        losses.aggregate_loss(X, MASK, "seq-mean-token-sum", norm_length=5)  # and only there
    with pytest.raises(ValueError, match="positive"):
        losses.loss_sum_and_units(X, MASK, "seq-mean-token-sum-norm", norm_length=0)


def test_loss_sum_and_units_by_hand_and_micro_batch_shares_add_up_to_the_whole_batch():
    # token-mean: 1 + 2 + 4 over 3 tokens; seq modes: per-row sums [3, 4] or means [1.5, 4] over 2 rows
    # seq-mean-token-sum-norm: row sums [3, 4] / 5 over 2 rows
    expected = {
        "token-mean": (7.0, 3.0),
        "seq-mean-token-sum": (7.0, 2.0),
        "seq-mean-token-mean": (5.5, 2.0),
        "seq-mean-token-sum-norm": (7.0 / 5, 2.0),
    }
    for mode, (total, units) in expected.items():
        length = 5 if mode == "seq-mean-token-sum-norm" else None
        got_sum, got_units = losses.loss_sum_and_units(X, MASK, mode, length)
        close(got_sum, total)
        assert got_units == units == losses.loss_units(MASK, mode)
        # one micro-batch per row, as two ranks would hold them: summed shares give the batch's loss
        shares = [losses.loss_sum_and_units(X[i : i + 1], MASK[i : i + 1], mode, length) for i in (0, 1)]
        whole = sum(s for s, _ in shares) / sum(u for _, u in shares)
        close(whole, losses.aggregate_loss(X, MASK, mode, norm_length=length))
    with pytest.raises(ValueError, match="'token-mean'"):
        losses.loss_sum_and_units(X, MASK, "sum")
