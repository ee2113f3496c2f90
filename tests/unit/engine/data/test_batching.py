import torch

from rlflow.engine.data.batching import PromptResponseIds, batch_indices, bootstrap_weights, left_pad, right_pad


def test_right_pad_masks_response_by_length_even_when_eos_is_the_pad_token():
    pad = eos = 0
    rows = [PromptResponseIds([5, 6], [7, eos]), PromptResponseIds([5], [eos])]
    ids, attention, response = right_pad(rows, pad)
    assert ids.tolist() == [[5, 6, 7, 0], [5, 0, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # The EOS (== pad) is a loss position in both rows; the true padding is not.
    assert response.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_left_pad():
    ids, attention = left_pad([[1, 2, 3], [4]], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]] and attention.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batches_are_a_pure_function_of_step_and_cover_each_epoch():
    n, size = 10, 4
    first_epoch = [i for step in (1, 2) for i in batch_indices(n, size, step, 0, 0)] + batch_indices(n, size, 3, 0, 0)[
        :2
    ]
    assert sorted(first_epoch) == list(range(n))  # steps 1..3 (10 items) are one permutation
    assert batch_indices(n, size, 3, 0, 0) == batch_indices(n, size, 3, 0, 0)
    assert batch_indices(n, size, 1, 0, 0) != batch_indices(n, size, 1, 1, 0)  # other seed, other order


def test_bootstrap_weights_are_each_heads_own_poisson_resample_and_a_pure_function_of_the_seed():
    weights = bootstrap_weights(4000, 4, 7, 0, 3)
    assert weights.shape == (4000, 4) and torch.equal(weights, bootstrap_weights(4000, 4, 7, 0, 3))
    assert not torch.equal(weights, bootstrap_weights(4000, 4, 8, 0, 3))  # another seed, other resamples
    assert torch.equal(weights, weights.round()) and weights.min() >= 0  # counts
    # Poisson(1): mean 1, variance 1, a share e^-1 of the items left out of each head's resample.
    assert torch.allclose(weights.mean(0), torch.ones(4), atol=0.05)
    assert torch.allclose(weights.var(0), torch.ones(4), atol=0.1)
    assert torch.allclose((weights == 0).float().mean(0), torch.full((4,), 0.3679), atol=0.03)
    assert all(not torch.equal(weights[:, 0], weights[:, h]) for h in (1, 2, 3))  # heads resample apart
    assert torch.equal(bootstrap_weights(5, 1, 7), torch.ones(5, 1))  # one head: every item once


def _chat_tokenizer():
    from helpers.chat_model import CORPUS
    from rlflow.engine.tasksets.demo import make_chat_tokenizer

    return make_chat_tokenizer(CORPUS)


def test_a_conversation_learns_every_assistant_turn_laid_out_as_an_episode():
    from rlflow.engine.data.batching import encode_conversation, pack_rows
    from rlflow.engine.data.records import SFTExample
    from rlflow.engine.envs.chat import ConversationEncoder

    tokenizer = _chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end
    turns = [{"role": "user", "content": "what is 12 plus 30"}, {"role": "assistant", "content": "tool says 17"},
             {"role": "tool", "content": "34"}, {"role": "user", "content": "and"},
             {"role": "assistant", "content": "the answer is 42"}]
    example = SFTExample(tuple(turns[:-1]), turns[-1]["content"], whole_conversation=True)
    row = encode_conversation(tokenizer, example, 512)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    episode = ConversationEncoder(tokenizer)
    observation = episode.observation_ids(turns[2:4], end)
    assert row.prompt == episode.prompt_ids(turns[:1])
    assert row.response == encode("tool says 17") + [end] + observation + encode("the answer is 42") + [end]
    # The same ids as the template's own rendering of the whole conversation (a byte-level tokenizer).
    whole = encode(tokenizer.apply_chat_template(turns, tokenize=False))
    assert row.prompt + row.response == whole[: len(row.prompt + row.response)]
    ids, _, mask = right_pad([row], tokenizer.pad_token_id)
    learned = ids[0][mask[0].bool()]
    assert tokenizer.decode(learned) == "tool says 17<|im_end|>the answer is 42<|im_end|>"
    assert mask[0].sum() == len(encode("tool says 17")) + len(encode("the answer is 42")) + 2
    packed = pack_rows([row, PromptResponseIds([5], [6, end])])
    assert packed.response_mask[0].tolist() == mask[0].tolist() + [0.0, 1.0, 1.0]


def test_a_long_conversation_is_cut_as_a_pair_is_and_an_opening_assistant_turn_is_context():
    from rlflow.engine.data.batching import encode_conversation
    from rlflow.engine.data.records import SFTExample

    tokenizer = _chat_tokenizer()
    turns = ({"role": "assistant", "content": "result 17"}, {"role": "user", "content": "what is 12 plus 30"},
             {"role": "assistant", "content": "the answer is 42"}, {"role": "user", "content": "and"})
    example = SFTExample(turns, "result 17", whole_conversation=True)
    full = encode_conversation(tokenizer, example, 512)
    assert tokenizer.decode(full.prompt).endswith("result 17<|im_end|>\n<|im_start|>user\nwhat is 12 plus 30"
                                                  "<|im_end|>\n<|im_start|>assistant\n")  # the opening turn: context
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert sum(full.learned) == len(encode("the answer is 42")) + len(encode("result 17")) + 2
    cut = encode_conversation(tokenizer, example, 12)
    assert len(cut.prompt) + len(cut.response) == 12 and len(cut.learned) == len(cut.response) == 11
    assert cut.response == full.response[:11] and cut.prompt == full.prompt[-1:]
