"""A generate reply's payload read back, and its segments expanded to one version per token."""

import torch

from rlflow.engine.rollout.worker_samples import generation_from_reply, token_versions


def test_segments_become_one_version_per_token():
    assert token_versions([[0, 3]], 4) == [3, 3, 3, 3]
    assert token_versions([[0, 3], [1, 4], [3, 6]], 5) == [3, 4, 4, 6, 6]
    assert token_versions([[0, 2]], 0) == []


def test_a_reply_becomes_rows_of_ids_log_probs_and_versions():
    ids, logprobs = torch.tensor([4, 5, 6], dtype=torch.int64), torch.tensor([-0.5, -1.0, -2.0])
    payload = memoryview(ids.numpy().tobytes() + logprobs.numpy().tobytes())
    generation = generation_from_reply({"lengths": [2, 1], "segments": [[[0, 1], [1, 2]], [[0, 1]]]}, payload)
    assert generation.response_ids == [[4, 5], [6]] and generation.logprobs == [[-0.5, -1.0], [-2.0]]
    assert generation.versions == [[1, 2], [1]]
    assert generation_from_reply({"lengths": [0]}, memoryview(b"")) == ([[]], [[]], None)
