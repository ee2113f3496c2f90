"""Turning a conversation into token ids without ever re-tokenising what the model wrote.

The prompt (the environment's first messages) is rendered by the chat template and tokenised once.
After that the ids only grow: the model's sampled ids are kept as sampled, and each observation
(tool results, a user's next message) is appended as the ids of *only the new messages*, wrapped
in the template's own delimiters and followed by its generation prompt. Decoding the conversation
and encoding it again can give other ids (a word the model spelled in two tokens comes back as
one); those are not the tokens it sampled, so they are never trained on.

The new messages' text comes from rendering them after a fixed two-message stand-in conversation
and keeping what follows the stand-in assistant turn: the template's end of an assistant turn, the
new messages and the generation prompt. The end-of-turn token the model itself sampled is removed
from its front. The rest is tokenised behind the stand-in answer, whose ids are then cut off, so a
tokenizer that starts a text with a dummy prefix (SentencePiece's '▁') does not put one mid-conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Message = dict[str, str]  # {"role": ..., "content": ...}

_STAND_IN_USER = "rlflow-stand-in-user-turn"
_STAND_IN_ANSWER = "rlflow-stand-in-assistant-turn"

TOOLS_SYSTEM_PROMPT = (
    "You can call these tools. To call one, write <tool_call>{{\"name\": <tool name>, \"arguments\": "
    "<an object>}}</tool_call> and end your turn; its result comes back in a tool message. When you "
    "know the answer, reply with it and no tool call.\n<tools>\n{schemas}\n</tools>"
)


# ChatML with tool turns, for tokenizers that come without a template (the demo's): it renders
# `tools=` in the system turn, one line per tool (name(arguments): description; short, so a tiny
# model's prompts stay short), an assistant message's `tool_calls` as <tool_call> JSON
# (what parse_hermes reads back) and a tool result as a `tool` turn. (HF renders templates
# with trim_blocks: a newline right after a block tag is dropped, hence the `{{ '\n' }}`.)
CHATML_TOOLS_TEMPLATE = (
    "{% set system = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{% if tools or system is not none %}<|im_start|>system\n"
    "{% if system is not none %}{{ system }}{% if tools %}{{ '\n\n' }}{% endif %}{% endif %}"
    "{% if tools %}Tools:{% for tool in tools %}{% set fn = tool.function or tool %}{{ '\n' }}"
    "{{ fn.name }}({{ fn.parameters.properties | join(', ') }}): {{ fn.description }}{% endfor %}{{ '\n' }}"
    "To call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> and end your turn."
    "{% endif %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set fn = call.function or call %}"
    "<tool_call>{{ {'name': fn.name, 'arguments': fn.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot carry this conversation; the message says what to change."""


def _render(tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def template_renders_tools(tokenizer: Any, tools: list[dict]) -> bool:
    """Whether the chat template writes the tool schemas itself (`tools=` changes its output)."""
    probe = [{"role": "user", "content": _STAND_IN_USER}]
    return _render(tokenizer, probe, tools, True) != _render(tokenizer, probe, None, True)


def with_tool_instructions(messages: list[Message], tools: list[dict]) -> list[Message]:
    """For a template that ignores `tools=`: the schemas (one JSON per line) and how to call them in
    a system message, before the conversation's own system text if it has one."""
    text = TOOLS_SYSTEM_PROMPT.format(schemas="\n".join(json.dumps(t, sort_keys=True) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": text + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_prompt(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] = ()) -> str:
    """The conversation so far as the template writes it, ending with the generation prompt, the tool
    schemas included: passed as `tools=` where the template renders them, else as a system message
    (with_tool_instructions). SFT rows with `tools` and episode prompts both come from here, so a
    policy is trained on the prompt it will be sampled from."""
    tools = list(tools)
    if tools and not template_renders_tools(tokenizer, tools):
        return _render(tokenizer, with_tool_instructions(list(messages), tools), None, True)
    return _render(tokenizer, messages, tools or None, True)


class ConversationEncoder:
    """Token ids of a conversation's first messages and of each observation after a model turn."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "multi-turn rollouts need a chat template: the tokenizer has none (data.chat_template: none, or a "
                "tokenizer saved without one); give the model directory a chat_template.jinja")
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self.template_tools = template_renders_tools(tokenizer, self.tools) if self.tools else False
        if self.tools:  # found now, at the stage's start, rather than at the first tool call of a step
            try:
                self.observation_ids([{"role": "tool", "content": "0"}], None)
            except Exception as exc:
                raise ChatTemplateError(
                    f"the chat template cannot write a 'tool' message ({type(exc).__name__}: {exc}); tool results need"
                    " a template with tool turns (e.g. rlflow.engine.envs.chat.CHATML_TOOLS_TEMPLATE)") from None

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first messages rendered with the generation prompt, tokenised: the trajectory's start."""
        return self._encode(render_prompt(self.tokenizer, messages, self.tools))

    def observation_ids(self, new_messages: list[Message], last_generated_id: int | None) -> list[int]:
        """Ids to append after a model turn that ended with `last_generated_id`: the template's end of an
        assistant turn (without its first id when that is the id the model ended on: its stop token),
        the new messages in its delimiters, then the generation prompt."""
        stand_in = [{"role": "user", "content": _STAND_IN_USER}, {"role": "assistant", "content": _STAND_IN_ANSWER}]
        text = _render(self.tokenizer, stand_in + list(new_messages), self._tools_arg(), True)
        start = text.find(_STAND_IN_ANSWER)
        if start < 0 or text.find(_STAND_IN_ANSWER, start + 1) >= 0:
            raise ChatTemplateError("the chat template does not write an assistant turn's content once, as given")
        ids = self._encode_after(_STAND_IN_ANSWER, text[start + len(_STAND_IN_ANSWER):])
        if ids and last_generated_id is not None and ids[0] == last_generated_id:
            return ids[1:]  # the model already wrote the template's end of turn
        return ids

    def _tools_arg(self) -> list[dict] | None:
        return self.tools if self.template_tools else None

    def _encode_after(self, before: str, text: str) -> list[int]:
        """`text`'s ids as they come after `before`: tokenised behind it, its ids then cut off. Alone,
        a SentencePiece tokenizer (Llama 2, Mistral) would start them with its dummy-prefix '▁',
        which the middle of a conversation does not have. Alone after all where a merge crosses
        the seam (the ids of `before` are not a prefix)."""
        head, ids = self._encode(before), self._encode(before + text)
        return ids[len(head):] if ids[: len(head)] == head else self._encode(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
