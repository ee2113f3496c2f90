"""Rollout batches: sampling one response per prompt on the tiny demo model (padding after the
stop, masks, texts, the seed), the batched log-probs/values/scores read at the right positions,
and merging batches sampled separately."""

import pytest
import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.models.tokens import stop_token_ids
from rlflow.engine.rollout.generate import (
    RolloutBatch,
    batched_logprobs,
    batched_scores,
    batched_values,
    generate_rollouts,
    merge_rollouts,
    pad_responses,
    sample_tokens,
)
from rlflow.engine.data.batching import left_pad

PARAMS = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def tiny(small_assets):
    model_dir = str(small_assets / "tiny-model")
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("1 + 2 =", "hello there", "7")]
    return load_policy(model_dir), tokenizer, prompts


class TokenValues(torch.nn.Module):
    """A scalar head whose value at each position is the token id there: reads are checkable by eye."""

    def forward(self, input_ids, attention_mask):
        return input_ids.float()


def test_responses_are_padded_after_their_stop_and_the_masks_agree(tiny):
    policy, tokenizer, prompts = tiny
    batch = generate_rollouts(policy, tokenizer, prompts, PARAMS, seed=3)
    width = max(len(p) for p in prompts)
    assert batch.prompt_width == width and batch.input_ids.shape[1] == width + batch.response_mask.shape[1]
    stops = stop_token_ids(tokenizer)
    for row, mask in zip(batch.response_ids.tolist(), batch.response_mask.tolist()):
        kept = [t for t, m in zip(row, mask) if m]
        assert mask == sorted(mask, reverse=True)  # 1s then 0s
        assert all(t == tokenizer.pad_token_id for t, m in zip(row, mask) if not m)
        assert len(kept) == PARAMS.max_new_tokens or kept[-1] in stops  # ends at its stop or the limit
    assert torch.equal(batch.attention_mask[:, width:], batch.response_mask.long())
    assert batch.response_texts == tuple(tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True))


def test_the_seed_fixes_the_draw(tiny):
    policy, tokenizer, prompts = tiny
    first, again = (generate_rollouts(policy, tokenizer, prompts, PARAMS, seed=3) for _ in range(2))
    other = generate_rollouts(policy, tokenizer, prompts, PARAMS, seed=4)
    assert torch.equal(first.input_ids, again.input_ids)
    assert not torch.equal(first.input_ids, other.input_ids)


def test_batched_logprobs_agree_with_the_samplers_and_are_zero_off_the_mask(tiny):
    policy, tokenizer, prompts = tiny
    ids, attention = left_pad(prompts, tokenizer.pad_token_id)
    stops = stop_token_ids(tokenizer)
    decoded = sample_tokens(policy, ids, attention, PARAMS, stops, tokenizer.pad_token_id, seed=5)
    batch = generate_rollouts(policy, tokenizer, prompts, PARAMS, seed=5)
    # a full forward in chunks of one row against the sampler's incremental decode
    logprobs = batched_logprobs(policy, batch, PARAMS.temperature, chunk=1)
    mask = batch.response_mask
    assert torch.allclose(logprobs, decoded.logprobs * mask, atol=1e-4)
    assert bool((logprobs[mask == 0] == 0).all())


def _batch(rows, prompt_width, mask):
    return RolloutBatch(
        torch.tensor(rows), torch.ones(len(rows), len(rows[0]), dtype=torch.long), torch.tensor(mask),
        prompt_width, tuple(f"t{i}" for i in range(len(rows))),
    )  # fmt: skip


def test_values_are_read_at_the_token_before_each_response_token():
    batch = _batch([[1, 2, 3, 4], [5, 6, 7, 8]], prompt_width=2, mask=[[1.0, 1.0], [1.0, 0.0]])
    # response token t (column 2 + t) takes the value at column 1 + t; the masked one is 0
    assert batched_values(TokenValues(), batch, chunk=1).tolist() == [[2.0, 3.0], [6.0, 0.0]]


def test_scores_are_read_at_the_last_attended_token():
    batch = _batch([[1, 2, 3], [4, 5, 6]], prompt_width=1, mask=[[1.0, 1.0], [1.0, 0.0]])
    batch = RolloutBatch(
        batch.input_ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), batch.response_mask, 1, batch.response_texts
    )
    assert batched_scores(TokenValues(), batch, chunk=1).tolist() == [3.0, 5.0]


def test_rows_select_ids_masks_and_texts_together():
    batch = _batch([[1, 2, 3], [4, 5, 6], [7, 8, 9]], prompt_width=1, mask=[[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    picked = batch.rows(torch.tensor([2, 0]))
    assert picked.input_ids.tolist() == [[7, 8, 9], [1, 2, 3]]
    assert picked.response_ids.tolist() == [[8, 9], [2, 3]]
    assert picked.response_mask.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert picked.response_texts == ("t2", "t0")


def test_merging_re_pads_prompts_left_and_responses_right():
    a = RolloutBatch(
        torch.tensor([[7, 8, 9, 10]]), torch.tensor([[1, 1, 1, 1]]), torch.tensor([[1.0, 1.0]]), 2, ("a",)
    )  # prompt 7 8, response 9 10
    b = RolloutBatch(torch.tensor([[5, 6, 7, 3]]), torch.tensor([[1, 1, 1, 1]]), torch.tensor([[1.0]]), 3, ("b",))
    merged = merge_rollouts([a, b], pad_id=0)
    assert merged.prompt_width == 3
    assert merged.input_ids.tolist() == [[0, 7, 8, 9, 10], [5, 6, 7, 3, 0]]
    assert merged.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert merged.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert merged.response_texts == ("a", "b")
    assert merge_rollouts([a], pad_id=0) is a


def test_pad_responses_right_pads_to_the_longest_with_the_value():
    out = pad_responses([torch.ones(1, 1), torch.full((2, 3), 2.0)], value=-1.0)
    assert out.tolist() == [[1.0, -1.0, -1.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
