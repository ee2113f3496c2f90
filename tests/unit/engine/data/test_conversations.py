"""Conversations in data files: prompts, preference pairs and SFT rows given as chat turns (TRL's
conversational and implicit-prompt forms), a row's tool schemas, and the one-line errors for each
malformed shape."""

import json

import pandas as pd
import pytest

from rlflow.engine.data.conversations import parse_tools, prompt_text
from rlflow.engine.data.records import (
    PreferencePair,
    PromptRecord,
    SFTExample,
    load_preference_pairs,
    load_prompts,
    load_sft_examples,
)
from rlflow.engine.envs.tools import CALCULATOR
from rlflow.engine.errors import DataError

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def raises_data_error(fn, *args) -> str:
    with pytest.raises(DataError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_conversations_as_prompts_and_preferences(tmp_path):
    history = CHAT + [{"role": "user", "content": "And in French?"}]
    url = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": history, "answer": "Bonjour"}, {"prompt": "plain"}])
    assert load_prompts(url) == [PromptRecord(tuple(history), {"answer": "Bonjour"}), PromptRecord("plain", {})]
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": [history]}).to_parquet(path)
    assert load_prompts(str(path)) == [PromptRecord(tuple(history), {})]
    answer = lambda text: [{"role": "assistant", "content": text}]
    rows = [
        {"prompt": history, "chosen": answer("Bonjour !"), "rejected": "Hola"},  # TRL's conversational form
        {"chosen": history + answer("Bonjour !"), "rejected": history + answer("Hola")},  # the implicit prompt
    ]
    expected = PreferencePair(prompt=tuple(history), chosen="Bonjour !", rejected="Hola")
    assert load_preference_pairs(write_jsonl(tmp_path / "prefs.jsonl", rows)) == [expected, expected]
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": history, "response": "Bonjour"}])
    assert load_sft_examples(sft) == [SFTExample(prompt=tuple(history), response="Bonjour")]


def test_bad_conversations_name_the_line_and_the_fix(tmp_path):
    answer = [{"role": "assistant", "content": "a"}]
    cases = [
        ("prompts", {"prompt": CHAT}, "the last message is the assistant's"),
        ("prompts", {"prompt": []}, "a non-empty list of {role, content} objects"),
        ("prompts", {"prompt": [{"role": "user", "content": 3}]}, "[0] needs a string 'content', got int"),
        ("prefs", {"prompt": CHAT[:2], "chosen": CHAT, "rejected": "b"}, "'chosen' holds 3 messages with a 'prompt'"),
        ("prefs", {"prompt": "p", "chosen": [CHAT[1]], "rejected": "b"}, "the last message must have role 'assistant'"),
        ("prefs", {"chosen": CHAT[:2] + answer, "rejected": CHAT[1:2] + answer}, "differ before their last assistant"),
        ("prefs", {"chosen": answer, "rejected": answer}, "'chosen' must be a list of at least 2"),
    ]
    for kind, row, fragment in cases:
        url = write_jsonl(tmp_path / f"{kind}.jsonl", [row])
        loader = load_prompts if kind == "prompts" else load_preference_pairs
        message = raises_data_error(loader, url)
        assert message.startswith(f"{url}:1:") and fragment in message, (row, message)


def test_sft_rows_carry_their_tool_schemas_and_bad_ones_are_refused(tmp_path):
    schema = CALCULATOR.schema()
    rows = [{"messages": CHAT[1:], "tools": [schema]}, {"prompt": "p", "response": "r"}]
    url = write_jsonl(tmp_path / "sft.jsonl", rows)
    assert [ex.tools for ex in load_sft_examples(url)] == [(schema,), ()]
    assert parse_tools("f", 1, None) == ()
    bad = [
        ("a string", "must be a list of function schemas, got an empty string"),
        ([{"name": "calculator"}], '[0] must be {"type": "function", "function": {"name": ..., "parameters": ...}}'),
        ([{"type": "function", "function": {"name": "c", "parameters": {"type": "array"}}}],
         "[0]: tool 'c': parameters must be a JSON schema with type 'object'"),
    ]
    for value, fragment in bad:
        with pytest.raises(DataError) as info:
            parse_tools("f.jsonl", 3, value)
        assert str(info.value).startswith("f.jsonl:3: field 'tools'") and fragment in str(info.value)


def test_a_conversation_reads_as_role_and_content_lines():
    assert prompt_text("plain") == "plain"
    assert prompt_text(tuple(CHAT[:2])) == "system: Be brief.\nuser: Hi"
