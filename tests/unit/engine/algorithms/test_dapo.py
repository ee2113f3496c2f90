"""Tests for rlflow.engine.algorithms.dapo: the soft overlong penalty and the groups dynamic sampling
keeps, against hand arithmetic."""

import pytest
import torch

from rlflow.engine.algorithms.dapo import informative_groups, overlong_penalty

T = torch.tensor


def test_overlong_penalty_ramps_over_the_buffer_by_hand():
    # budget 10, buffer 4: free up to 6 tokens, then -factor x (L - 6) / 4, -factor at 10 and beyond
    lengths = T([0, 6, 7, 8, 10, 12])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), T([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    torch.testing.assert_close(overlong_penalty(T([10.0]), 10, 10, 1.0), T([-1.0]))  # the whole budget
    for bad in (0, 11):
        with pytest.raises(ValueError, match="1..max_length=10"):
            overlong_penalty(lengths, 10, bad, 1.0)


def test_informative_groups_by_hand():
    scores = T([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert informative_groups(scores, 2).tolist() == [False, True, False, False]
    assert informative_groups(scores, 4).tolist() == [True, True]
    assert informative_groups(T([0.3, 0.3 + 1e-8]), 2).tolist() == [False]  # within rounding: equal
    with pytest.raises(ValueError, match="rollout.n=3"):
        informative_groups(scores, 3)
    with pytest.raises(ValueError, match=">= 2"):
        informative_groups(scores, 1)
