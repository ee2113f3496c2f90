"""The tool-using environment: the row's question, then each model turn's tool calls run and their
results sent back as `tool` messages, until a turn calls no tool: that turn is the final answer,
scored by the run's reward sources (a tool's result is never the answer)."""

from __future__ import annotations

from typing import Any

from rlflow.engine.envs.base import EnvStep
from rlflow.engine.envs.chat import Message
from rlflow.engine.envs.tool_calls import tool_call_parser
from rlflow.engine.envs.tools import CALCULATOR, Tool, call_tool, python_tool

BUILTIN_TOOLS = ("calculator", "python")


def builtin_tool(name: str) -> Tool:
    if name == "calculator":
        return CALCULATOR
    if name == "python":
        return python_tool()
    raise ValueError(f"unknown tool {name!r}; valid: {', '.join(BUILTIN_TOOLS)}")


class ToolEnv:
    """kwargs: `tools` (built-in names), `parser` (a TOOL_CALL_PARSERS name), `system` (text put first)."""

    def __init__(self, tools: list[str] = ("calculator",), parser: str = "hermes", system: str | None = None):
        self.tools = {t.name: t for t in (builtin_tool(name) for name in tools)}
        self.parse = tool_call_parser(parser)
        self.system = system

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def reset(self, row: dict[str, Any]) -> list[Message]:
        prompt = row["prompt"]  # a string, or the conversation so far as {role, content} turns
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(t) for t in prompt]
        if self.system is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": self.system})
        return messages

    def step(self, assistant_message: str) -> EnvStep:
        turn = self.parse(assistant_message)
        if not turn.attempted:
            return EnvStep(done=True)
        results = [call_tool(self.tools, call) for call in turn.calls]
        observation = [{"role": "tool", "content": text} for text, _ in results]
        observation += [{"role": "tool", "content": f"error: {reason}"} for reason in turn.errors]
        failed = sum(not ok for _, ok in results) + len(turn.errors)
        return EnvStep(observation=observation, info={"tool_calls": float(len(results)), "tool_errors": float(failed)})
