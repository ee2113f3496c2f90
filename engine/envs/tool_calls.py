"""Reading tool calls out of a model's turn, in the format its chat template taught it.

`TOOL_CALL_PARSERS` maps `env.tool_parser` to a parser: text in, `ParsedTurn` out. A call the model
got wrong (bad JSON, no name, an unclosed tag) is kept as an error for the environment to answer
with, never raised.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rlflow.engine.envs.tools import ToolCall

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The turn's text outside any tool call (the answer, when there is no call)."""
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = field(default=())
    """One message per call that could not be read."""

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


def _call_from_json(text: str, arguments_key: str) -> ToolCall | str:
    """A ToolCall from `{"name": ..., arguments_key: {...}}`, or the reason it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the tool call is not valid JSON ({exc.msg} at char {exc.pos}): {text.strip()[:120]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f"a tool call needs a JSON object with a string 'name': {text.strip()[:120]!r}"
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some templates emit the arguments JSON-encoded
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"tool call {obj['name']!r}: '{arguments_key}' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"tool call {obj['name']!r}: '{arguments_key}' must be an object, got {type(arguments).__name__}"
    return ToolCall(name=obj["name"], arguments=arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen style: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    calls, errors = [], []
    for block in _HERMES_BLOCK.findall(text):
        result = _call_from_json(block, "arguments")
        (errors if isinstance(result, str) else calls).append(result)
    content = _HERMES_BLOCK.sub("", text)
    if TOOL_CALL_OPEN in content:
        errors.append(f"a {TOOL_CALL_OPEN} was opened and never closed with {TOOL_CALL_CLOSE}")
        content = content[: content.index(TOOL_CALL_OPEN)]
    return ParsedTurn(content=content.strip(), calls=tuple(calls), errors=tuple(errors))


def parse_json_object(text: str) -> ParsedTurn:
    """Llama-3.x style: a turn that is one JSON object `{"name": ..., "parameters": {...}}` is a call;
    any other turn is an answer."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return ParsedTurn(content=stripped)
    result = _call_from_json(stripped, "parameters")
    if isinstance(result, str):
        return ParsedTurn(content="", errors=(result,))
    return ParsedTurn(content="", calls=(result,))


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "json_object": parse_json_object,
}


def tool_call_parser(name: str) -> Callable[[str], ParsedTurn]:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; valid: {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]
