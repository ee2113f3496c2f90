"""The tool environment's episode: calls are run and answered, mistakes are observations, a turn
without a call ends it."""

from rlflow.engine.envs.base import EnvStep
from rlflow.engine.envs.tool_env import ToolEnv, builtin_tool

import pytest


def test_an_episode_calls_the_calculator_then_answers():
    env = ToolEnv(tools=["calculator"], system="Use the calculator.")
    assert env.reset({"prompt": "1234 * 5678?"}) == [
        {"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "1234 * 5678?"}]
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>')
    assert step == EnvStep(observation=[{"role": "tool", "content": "7006652"}],
                           info={"tool_calls": 1.0, "tool_errors": 0.0})
    assert env.step("It is 7006652.") == EnvStep(done=True)


def test_mistakes_come_back_as_tool_messages():
    env = ToolEnv()
    step = env.step('<tool_call>{"name": "calc", "arguments": {}}</tool_call><tool_call>{bad</tool_call>')
    assert [m["content"][:40] for m in step.observation] == [
        "error: unknown tool 'calc'; available: c", "error: the tool call is not valid JSON ("]
    assert step.info == {"tool_calls": 1.0, "tool_errors": 2.0} and not step.done


def test_multi_turn_rows_keep_their_history_and_unknown_tools_are_refused():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "2+2?"}]
    prompt = tuple(history)  # how load_prompts gives a conversation
    assert ToolEnv().reset({"prompt": prompt}) == history
    assert ToolEnv(system="S").reset({"prompt": prompt})[0] == {"role": "system", "content": "S"}
    with pytest.raises(ValueError, match="unknown tool 'shell'; valid: calculator, python"):
        builtin_tool("shell")
