"""Tests for rlflow.engine.data.records: file formats, validation messages, prompt encoding."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest

from rlflow.engine.data.records import (
    EncodedPrompts,
    PreferencePair,
    PromptRecord,
    SFTExample,
    encode_prompts,
    fingerprint_file,
    format_prompt,
    load_preference_pairs,
    load_prompts,
    load_sft_examples,
    read_rows,
)
from rlflow.engine.errors import DataError

SFT_ROWS = [
    {"prompt": "What is 2+2?", "response": "4"},
    {"prompt": "Name a colour, please", "response": "blue"},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


def write_jsonl(path, rows, blank_after_first=False):
    """Write rows as JSON Lines, optionally with blank spacer lines after the first row."""
    lines = [json.dumps(r) for r in rows]
    if blank_after_first:
        lines.insert(1, "")
        lines.insert(1, "   ")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def raises_data_error(fn, *args) -> str:
    """Call fn, expect a DataError with a one-line message, and return the message."""
    with pytest.raises(DataError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- formats


def test_jsonl_round_trip_skips_blank_lines(tmp_path):
    url = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS, blank_after_first=True)
    assert [line for line, _ in read_rows(url)] == [1, 4]
    assert load_sft_examples(url) == [SFTExample(r["prompt"], r["response"]) for r in SFT_ROWS]


def test_json_extension_and_gzip_are_read_as_jsonl(tmp_path):
    plain = write_jsonl(tmp_path / "sft.json", SFT_ROWS)
    gz = tmp_path / "sft.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "sft.json").read_bytes()))
    expected = [SFTExample(r["prompt"], r["response"]) for r in SFT_ROWS]
    assert load_sft_examples(plain) == expected
    assert load_sft_examples(str(gz)) == expected


def test_csv_round_trip_reports_physical_lines(tmp_path):
    rows = [
        {"prompt": "line one\nline two", "chosen": "a, b", "rejected": "c"},
        {"prompt": "p2", "chosen": "x", "rejected": "y"},
    ]
    path = tmp_path / "prefs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    # The header is line 1 and the first prompt spans lines 2-3, so row two starts on line 4.
    assert [line for line, _ in read_rows(str(path))] == [2, 4]
    assert load_preference_pairs(str(path)) == [PreferencePair(**r) for r in rows]


def test_parquet_round_trip_keeps_extra_fields(tmp_path):
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": ["p1", "p2"], "answer": ["42", "7"], "level": [1, 2]}).to_parquet(path)
    assert load_prompts(str(path)) == [
        PromptRecord("p1", {"answer": "42", "level": 1}),
        PromptRecord("p2", {"answer": "7", "level": 2}),
    ]


def test_messages_format_jsonl_and_parquet(tmp_path):
    expected = [SFTExample(prompt=tuple(CHAT[:-1]), response="Hello!", whole_conversation=True)]
    url = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    assert load_sft_examples(url) == expected
    path = tmp_path / "chat.parquet"
    pd.DataFrame({"messages": [CHAT]}).to_parquet(path)
    assert load_sft_examples(str(path)) == expected


# --------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    url = str(tmp_path / "nope.jsonl")
    message = raises_data_error(read_rows, url)
    assert message == f"data file not found: {url}; check the path in the config"


def test_unsupported_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello\n")
    message = raises_data_error(read_rows, str(path))
    assert str(path) in message and ".jsonl" in message and ".parquet" in message


def test_malformed_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a",, }\n')
    message = raises_data_error(read_rows, str(path))
    assert f"{path}:2:" in message and "malformed JSON" in message


def test_json_line_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"prompt": "a"}\n\n[1, 2]\n')
    message = raises_data_error(read_rows, str(path))
    assert f"{path}:3:" in message and "list" in message


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_jsonl(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    assert raises_data_error(read_rows, str(path)).startswith(f"{path} contains no records")


def test_header_only_csv_is_empty(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("prompt,response\n")
    assert raises_data_error(read_rows, str(path)).startswith(f"{path} contains no records")


def test_missing_response_field(tmp_path):
    url = write_jsonl(tmp_path / "sft.jsonl", [SFT_ROWS[0], {"prompt": "only a prompt"}])
    message = raises_data_error(load_sft_examples, url)
    assert message == (f"{url}:2: missing field 'response' (SFT rows need 'prompt' and 'response', or 'messages')")


def test_wrong_type_and_empty_fields(tmp_path):
    url = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": 3, "response": "x"}])
    message = raises_data_error(load_sft_examples, url)
    assert f"{url}:1:" in message and "'prompt'" in message and "int" in message
    path = tmp_path / "sft.csv"
    path.write_text("prompt,response\nhello,\n")  # empty CSV cell
    message = raises_data_error(load_sft_examples, str(path))
    assert f"{path}:2:" in message and "'response'" in message and "empty" in message


def test_bad_messages(tmp_path):
    url = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[:-1]}])
    message = raises_data_error(load_sft_examples, url)
    assert f"{url}:1:" in message and "'messages'" in message and "assistant" in message
    url = write_jsonl(tmp_path / "chat2.jsonl", [{"messages": [{"role": "user"}, CHAT[-1]]}])
    message = raises_data_error(load_sft_examples, url)
    assert f"{url}:1:" in message and "'content'" in message


def test_preference_and_prompt_missing_fields(tmp_path):
    url = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "a"}])
    message = raises_data_error(load_preference_pairs, url)
    assert f"{url}:1:" in message and "'rejected'" in message
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": ["ok", None]}).to_parquet(path)
    message = raises_data_error(load_prompts, str(path))
    assert f"{path}:2:" in message and "'prompt'" in message


def test_csv_field_count_mismatch(tmp_path):
    path = tmp_path / "sft.csv"
    path.write_text("prompt,response\na,b\nc,d,e\n")
    message = raises_data_error(read_rows, str(path))
    assert f"{path}:3:" in message and "header" in message


# --------------------------------------------------------------------------- tokens


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny word-level BPE tokenizer trained in-process (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<eos>", "<unk>"])
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "what is two plus two",
        "name a colour please",
        "hello there how are you today",
    ]
    raw.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_format_prompt_without_template(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    assert format_prompt(tokenizer, "hello there") == "hello there"
    assert format_prompt(tokenizer, tuple(CHAT[:-1])) == "Be brief.\nHi"


def test_format_prompt_with_template(tokenizer, monkeypatch):
    template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template, raising=False)
    assert format_prompt(tokenizer, "hello") == "[user]hello\n[assistant]"
    assert format_prompt(tokenizer, tuple(CHAT[:-1])) == "[system]Be brief.\n[user]Hi\n[assistant]"


def test_encode_prompts_truncate_keeps_last_tokens(tokenizer):
    prompts = ["the quick brown fox jumps over the lazy dog", "hello there"]
    full = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert len(full[0]) > 4 >= len(full[1])
    encoded = encode_prompts(tokenizer, prompts, max_prompt_tokens=4, overflow="truncate")
    assert encoded == EncodedPrompts(token_ids=[full[0][-4:], full[1]], kept_indices=[0, 1], n_truncated=1, n_dropped=0)


def test_encode_prompts_drop(tokenizer):
    prompts = ["hello there", "the quick brown fox jumps over the lazy dog", "what is two"]
    encoded = encode_prompts(tokenizer, prompts, max_prompt_tokens=4, overflow="drop")
    assert encoded.kept_indices == [0, 2]
    assert (encoded.n_truncated, encoded.n_dropped) == (0, 1)
    assert encoded.token_ids[1] == tokenizer("what is two", add_special_tokens=False)["input_ids"]


def test_encode_prompts_unknown_overflow(tokenizer):
    with pytest.raises(ValueError, match="truncate, drop"):
        encode_prompts(tokenizer, ["hi"], max_prompt_tokens=4, overflow="clip")


# --------------------------------------------------------------------------- identity


def test_fingerprint_changes_with_one_byte(tmp_path):
    path = tmp_path / "sft.jsonl"
    url = write_jsonl(path, SFT_ROWS)
    first = fingerprint_file(url)
    assert first == fingerprint_file(url) and len(first) == 64
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    assert fingerprint_file(url) != first
    with pytest.raises(DataError, match="data file not found"):
        fingerprint_file(str(tmp_path / "missing.jsonl"))
