"""Reward-model scores normalised by a reference set's (mean, std), in row chunks; an ensemble's heads
each by their own, and its mean, spread and uncertainty-penalised reward."""

import pytest
import torch

from rlflow.engine.rewards.model_scores import (
    ensemble_mean_std,
    normalised_head_scores,
    normalised_scores,
    penalised_scores,
)
from rlflow.engine.rollout.generate import RolloutBatch


class LastTokenScorer(torch.nn.Module):
    """A scalar 'reward model' whose value at each position is the token id there: the score of a
    row is the id of its last attended token, so every expected number is read off the batch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, input_ids, attention_mask):
        self.calls.append(input_ids.shape[0])
        return input_ids.float()


def batch_of(rows, masks, prompt_width=2):
    return RolloutBatch(
        input_ids=torch.tensor(rows),
        attention_mask=torch.tensor(masks),
        response_mask=torch.tensor(masks, dtype=torch.float32)[:, prompt_width:],
        prompt_width=prompt_width,
        response_texts=tuple(f"r{i}" for i in range(len(rows))),
    )


def test_scores_are_read_at_the_last_attended_token_and_normalised():
    batch = batch_of([[0, 5, 7, 9], [4, 5, 6, 0], [1, 2, 3, 8]], [[0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    # raw: 9, 6 (the pad after it is not attended), 8; mean 7, std 2
    scores = normalised_scores(LastTokenScorer(), batch, (7.0, 2.0))
    assert scores.tolist() == pytest.approx([1.0, -0.5, 0.5])


def test_chunks_cover_every_row_once_and_do_not_change_the_scores():
    rows = [[i, i + 1, i + 2] for i in range(5)]
    batch = batch_of(rows, [[1, 1, 1]] * 5, prompt_width=1)
    model = LastTokenScorer()
    chunked = normalised_scores(model, batch, (0.0, 1.0), chunk=2)
    assert model.calls == [2, 2, 1]
    assert chunked.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert torch.equal(chunked, normalised_scores(LastTokenScorer(), batch, (0.0, 1.0), chunk=64))


class HeadsScorer(torch.nn.Module):
    """An ensemble 'reward model' of len(scales) heads: head h's value is the token id times scales[h]."""

    def __init__(self, scales):
        super().__init__()
        self.scales = torch.tensor(scales)

    def forward(self, input_ids, attention_mask):
        return input_ids.float()[..., None] * self.scales


def test_an_ensembles_heads_are_each_normalised_by_their_own_statistics():
    batch = batch_of([[0, 5, 7, 9], [4, 5, 6, 0]], [[0, 1, 1, 1], [1, 1, 1, 0]])
    # raw heads: 9 x (1, 2, -1) and 6 x (1, 2, -1); per-head norms ((7, 14, -7), (2, 4, 2))
    heads = normalised_head_scores(HeadsScorer([1.0, 2.0, -1.0]), batch, ((7.0, 14.0, -7.0), (2.0, 4.0, 2.0)))
    assert torch.allclose(heads, torch.tensor([[1.0, 1.0, -1.0], [-0.5, -0.5, 0.5]]))
    one = normalised_head_scores(LastTokenScorer(), batch, (7.0, 2.0))
    assert one.shape == (2, 1) and one[:, 0].tolist() == pytest.approx([1.0, -0.5])
    # The ensemble's score is the heads' mean: (1 + 1 - 1) / 3 and (-0.5 - 0.5 + 0.5) / 3.
    mean = normalised_scores(HeadsScorer([1.0, 2.0, -1.0]), batch, ((7.0, 14.0, -7.0), (2.0, 4.0, 2.0)))
    assert mean.tolist() == pytest.approx([1 / 3, -1 / 6])


def test_the_penalised_reward_is_the_mean_less_lambda_times_the_unbiased_std():
    heads = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.5, 0.5, 0.5, 0.5]])
    mean, std = ensemble_mean_std(heads)
    # Row 0: mean 3, deviations -2 -1 0 3, sum of squares 14, unbiased variance 14 / 3.
    assert mean.tolist() == pytest.approx([3.0, 0.5])
    assert std.tolist() == pytest.approx([(14 / 3) ** 0.5, 0.0])
    assert penalised_scores(heads, 0.5).tolist() == pytest.approx([3.0 - 0.5 * (14 / 3) ** 0.5, 0.5])
    assert torch.equal(penalised_scores(heads, 0.0), mean)
    one = torch.tensor([[2.0], [-1.0]])  # a single head: no spread, nothing to penalise
    assert ensemble_mean_std(one)[1].tolist() == [0.0, 0.0]
    assert penalised_scores(one, 3.0).tolist() == [2.0, -1.0]
