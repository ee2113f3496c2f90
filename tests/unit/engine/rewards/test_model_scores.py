"""Reward-model scores normalised by a reference set's (mean, std), in row chunks."""

import pytest
import torch

from rlflow.engine.rewards.model_scores import normalised_scores
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
