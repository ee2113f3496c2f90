"""A data row's chat parts, validated: the conversation so far as {role, content} turns, an answer
given as text or as one assistant message, a row's tool schemas, and a prompt as readable text.

Every problem names the file, the 1-based line and the field, and says what the value must be,
because the CLI prints only that one line (engine/data/records.py builds the records from these).
"""

from __future__ import annotations

from typing import Any

from rlflow.engine.envs.tools import ToolSchemaError, check_parameters
from rlflow.engine.errors import DataError

Prompt = str | tuple[dict, ...]  # a prompt string, or the conversation so far


def describe(value: Any) -> str:
    """Short description of a bad value for error messages."""
    if isinstance(value, str):
        return "an empty string"
    return "null" if value is None else type(value).__name__


def require_str(url: str, lineno: int, row: dict, name: str, hint: str) -> str:
    """Return row[name] if it is a non-blank string, else raise a DataError naming it."""
    if name not in row or row[name] is None:
        raise DataError(f"{url}:{lineno}: missing field {name!r} ({hint})")
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{url}:{lineno}: field {name!r} must be a non-empty string, got {describe(value)} ({hint})")
    return value


def parse_turns(where: str, messages: Any, minimum: int, shape: str) -> tuple[dict, ...]:
    """Validate a list of chat turns into {role, content} dicts; `shape` says what the list must be."""
    if not isinstance(messages, list) or len(messages) < minimum:
        got = f"{len(messages)} message(s)" if isinstance(messages, list) else describe(messages)
        raise DataError(f"{where} must be {shape}, got {got}")
    turns = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise DataError(f"{where}[{i}] must be a {{role, content}} object, got {describe(msg)}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                raise DataError(f"{where}[{i}] needs a string {key!r}, got {describe(msg.get(key))}")
        # Only role/content: Parquet structs add null keys that would confuse chat templates.
        turns.append({"role": msg["role"], "content": msg["content"]})
    return tuple(turns)


def split_last_assistant(where: str, turns: tuple[dict, ...]) -> tuple[tuple[dict, ...], str]:
    """(the history, the final assistant turn's text) of a conversation that ends with the answer."""
    last = turns[-1]
    if last["role"] != "assistant":
        raise DataError(
            f"{where}: the last message must have role 'assistant' (it is the response to learn), got {last['role']!r}"
        )
    if not last["content"].strip():
        raise DataError(f"{where}: the final assistant message has empty content")
    return turns[:-1], last["content"]


def parse_prompt(url: str, lineno: int, row: dict, hint: str) -> Prompt:
    """A prompt string, or the conversation so far as {role, content} turns (the model answers next)."""
    value = row.get("prompt")
    if not isinstance(value, list):
        return require_str(url, lineno, row, "prompt", hint)
    where = f"{url}:{lineno}: field 'prompt'"
    turns = parse_turns(where, value, 1, "a non-empty list of {role, content} objects (the conversation so far)")
    if turns[-1]["role"] == "assistant":
        raise DataError(
            f"{where}: the last message is the assistant's; a prompt ends with the turn the model answers "
            "(move the answer to the response)"
        )
    return turns


def parse_answer(url: str, lineno: int, row: dict, key: str, hint: str) -> str:
    """A response string, or one assistant turn as a one-message list (the conversational format)."""
    value = row.get(key)
    if not isinstance(value, list):
        return require_str(url, lineno, row, key, hint)
    where = f"{url}:{lineno}: field {key!r}"
    turns = parse_turns(where, value, 1, "a string or a list holding the one assistant message")
    if len(turns) != 1:
        raise DataError(
            f"{where} holds {len(turns)} messages with a 'prompt' field; give only the assistant's answer, "
            "or drop 'prompt' and give both whole conversations"
        )
    return split_last_assistant(where, turns)[1]


def parse_tools(url: str, lineno: int, value: Any) -> tuple[dict, ...]:
    """A row's `tools`: function schemas as `apply_chat_template(..., tools=...)` takes them."""
    where = f"{url}:{lineno}: field 'tools'"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise DataError(f"{where} must be a list of function schemas, got {describe(value)}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            shape = '{"type": "function", "function": {"name": ..., "parameters": ...}}'
            raise DataError(f"{where}[{i}] must be {shape}")
        try:
            check_parameters(function["name"], function.get("parameters"))
        except ToolSchemaError as exc:
            raise DataError(f"{where}[{i}]: {exc}") from None
    return tuple(value)


def prompt_text(prompt: Prompt) -> str:
    """A prompt as one readable string (for reports and error messages): a conversation's turns
    as "role: content" lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{turn['role']}: {turn['content']}" for turn in prompt)
