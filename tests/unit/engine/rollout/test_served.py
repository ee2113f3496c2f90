"""A replica's samples as the trainer's batch (rlflow.engine.rollout.served): padding, masks and the
sampler's log-probs, on a hand-made Generation (a real replica's: test_hf_replica.py)."""

import pytest

from rlflow.engine.models.loading import load_tokenizer
from rlflow.engine.rollout.served import build_rollout_batch
from rlflow.engine.rollout.replica import ReplicaError
from rlflow.engine.rollout.replica import Generation


def test_a_generation_becomes_the_batch_generate_rollouts_would_build(small_assets):
    tokenizer = load_tokenizer(str(small_assets / "tiny-model"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    generation = Generation([[7, eos], [8, 9, 5]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]])
    batch = build_rollout_batch(tokenizer, [[1, 2], [3]], generation, max_new_tokens=3)
    assert batch.prompt_width == 2
    assert batch.input_ids.tolist() == [[1, 2, 7, eos, pad], [pad, 3, 8, 9, 5]]  # prompts left-, responses right-padded
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert batch.sampled_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]


def test_a_short_response_without_eos_is_refused_with_the_cause(small_assets):
    tokenizer = load_tokenizer(str(small_assets / "tiny-model"))
    with pytest.raises(ReplicaError, match=r"2-token response without EOS \(max_new_tokens=3\).*eos_token_id"):
        build_rollout_batch(tokenizer, [[1]], Generation([[7, 8]], [[-1.0, -1.0]]), max_new_tokens=3)


def test_a_row_is_as_old_as_its_oldest_token(small_assets):
    tokenizer = load_tokenizer(str(small_assets / "tiny-model"))
    eos = tokenizer.eos_token_id
    generation = Generation([[7, eos], [8, 9, 5]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]], [[3, 4], [4, 4, 4]])
    assert build_rollout_batch(tokenizer, [[1], [3]], generation, 3).sampled_versions.tolist() == [3, 4]
    assert build_rollout_batch(tokenizer, [[1], [3]], generation, 3, version=2).sampled_versions.tolist() == [2, 2]
    assert build_rollout_batch(tokenizer, [[1], [3]], generation._replace(versions=None), 3).sampled_versions is None
