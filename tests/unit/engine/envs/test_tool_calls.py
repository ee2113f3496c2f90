"""Tool-call parsers: well-formed calls are read, malformed ones become errors, never exceptions."""

import pytest

from rlflow.engine.envs.tool_calls import ParsedTurn, parse_hermes, parse_json_object, tool_call_parser
from rlflow.engine.envs.tools import ToolCall


def test_hermes_reads_every_call_and_keeps_the_text_around_them():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>\n'
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    assert parse_hermes(text) == ParsedTurn(content="Let me compute.", calls=(
        ToolCall("calculator", {"expression": "2*3"}), ToolCall("python", {"code": "print(1)"})))


def test_a_turn_without_a_call_is_an_answer():
    turn = parse_hermes("The answer is 42.")
    assert turn == ParsedTurn(content="The answer is 42.") and not turn.attempted


@pytest.mark.parametrize(("text", "error"), [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}</tool_call>',
     "the tool call is not valid JSON (Expecting ',' delimiter at char 57)"),
    ('<tool_call>{"arguments": {}}</tool_call>', "a tool call needs a JSON object with a string 'name'"),
    ('<tool_call>["calculator"]</tool_call>', "a tool call needs a JSON object with a string 'name'"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
     "tool call 'calculator': 'arguments' must be an object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": "{1"}</tool_call>',
     "tool call 'calculator': 'arguments' is a string that is not JSON"),
    ('7 <tool_call>{"name": "calculator", "arguments": {}}', "a <tool_call> was opened and never closed"),
])
def test_a_malformed_call_is_an_error_for_the_model_to_read(text, error):
    turn = parse_hermes(text)
    assert turn.calls == () and turn.attempted and len(turn.errors) == 1
    assert turn.errors[0].startswith(error)


def test_json_object_style():
    assert parse_json_object('{"name": "calculator", "parameters": {"expression": "1+1"}}') == ParsedTurn(
        content="", calls=(ToolCall("calculator", {"expression": "1+1"}),))
    assert parse_json_object("It is 2.") == ParsedTurn(content="It is 2.")
    assert parse_json_object("{oops").errors[0].startswith("the tool call is not valid JSON")


def test_an_unknown_parser_lists_the_valid_ones():
    assert tool_call_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'; valid: hermes, json_object"):
        tool_call_parser("qwen")


def test_hermes_reads_back_the_calls_the_chat_template_writes():
    from rlflow.engine.tasksets.demo import make_chat_tokenizer

    tokenizer = make_chat_tokenizer(["calculator"])
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}},
             {"name": "python", "arguments": {"code": "print('hi')"}}]
    text = tokenizer.apply_chat_template([{"role": "assistant", "content": "Let me check.", "tool_calls": calls}],
                                         tokenize=False)
    turn = text.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    assert parse_hermes(turn) == ParsedTurn(content="Let me check.", calls=(
        ToolCall("calculator", {"expression": "12 * 7"}), ToolCall("python", {"code": "print('hi')"})))
