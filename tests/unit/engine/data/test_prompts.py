"""A stage's prompt set: prompts formatted and tokenized in order, data.max_prompt_tokens applied by
data.prompt_overflow (the counts returned), an episode's first messages in place of a prompt with an
env, and an empty set named by its file."""

import pytest

from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.data.records import PromptRecord
from rlflow.engine.errors import DataError
from rlflow.engine.models.loading import load_tokenizer

RECORDS = [PromptRecord(p, {"bonus": i}) for i, p in enumerate(["1 + 1 =", "2 + 5 =", "hello", "3 x 3 ="])]


@pytest.fixture(scope="module")
def tokenizer(small_assets):
    return load_tokenizer(str(small_assets / "tiny-model"))


def test_prompts_are_encoded_in_order_and_an_empty_set_names_the_file(tokenizer):
    prompts, truncated, dropped = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    assert prompts.records == tuple(RECORDS) and (truncated, dropped) == (0, 0)
    assert list(prompts.token_ids[2]) == tokenizer("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(DataError, match=r"eval\.jsonl: every prompt is longer than data\.max_prompt_tokens=1"):
        encode_prompt_set(tokenizer, [PromptRecord("a much longer prompt than one token", {})], 1, "drop", "eval.jsonl")


def test_the_overflow_policy_truncates_to_the_last_tokens_or_drops(tokenizer):
    ids = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in RECORDS]
    limit = min(len(i) for i in ids)
    longer = sum(len(i) > limit for i in ids)
    assert longer > 0
    kept, truncated, dropped = encode_prompt_set(tokenizer, RECORDS, limit, "truncate", "p.jsonl")
    assert (truncated, dropped) == (longer, 0) and [list(t) for t in kept.token_ids] == [i[-limit:] for i in ids]
    kept, truncated, dropped = encode_prompt_set(tokenizer, RECORDS, limit, "drop", "p.jsonl")
    assert (truncated, dropped) == (0, longer) and len(kept.records) == len(RECORDS) - longer


class FirstMessages:
    """Stands in for an episode sampler: each record's first messages are three fixed ids per word."""

    def prompt_ids(self, records):
        return [[7, 8, 9] * len(r.prompt.split()) for r in records]


def test_with_episodes_a_prompt_is_its_episodes_first_messages(tokenizer):
    kept, truncated, dropped = encode_prompt_set(tokenizer, RECORDS, 6, "drop", "p.jsonl", FirstMessages())
    assert [r.prompt for r in kept.records] == ["hello"] and dropped == 3  # 9 ids each for the sums
    with pytest.raises(DataError, match=r"as an episode's first messages \(tool instructions included\)"):
        encode_prompt_set(tokenizer, RECORDS, 2, "drop", "p.jsonl", FirstMessages())
