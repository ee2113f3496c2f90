"""Tools and their calls: the calculator's arithmetic, schema checks, and every way a model's call can
go wrong coming back as an observation rather than an exception."""

import pytest

from rlflow.engine.envs import sandbox, tools
from rlflow.engine.envs.tools import CALCULATOR, Tool, ToolCall, ToolSchemaError, calculator, call_tool


@pytest.mark.parametrize(("expression", "value"), [
    ("1234 * 5678", "7006652"), ("(2 + 3) * -4", "-20"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("17 // 5", "3"),
    ("17 % 5", "2"), ("2 ** 10", "1024"), (" 0.1 + 0.2 ", "0.30000000000000004"),
])
def test_calculator_computes_exactly(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('x')", "unsupported expression"), ("1 +", "cannot parse"),
    ("2 ** 1000", "exponent 1000 is larger than 64"), ("x * 2", "unsupported expression"),
    ("9 ** 60 * 9 ** 60", "more than 100 digits"), ("True + 1", "unsupported expression"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_the_schema_is_what_chat_templates_take():
    assert CALCULATOR.schema() == {"type": "function", "function": {
        "name": "calculator", "description": CALCULATOR.description, "parameters": CALCULATOR.parameters}}


@pytest.mark.parametrize(("parameters", "message"), [
    ({"type": "array"}, "parameters must be a JSON schema with type 'object'"),
    ({"type": "object", "properties": {"x": {"type": "float"}}}, "argument 'x' has type 'float'; valid: string"),
    ({"type": "object", "properties": {"x": "string"}}, "argument 'x' has type None"),
    ({"type": "object", "properties": {}, "required": ["x"]}, r"required \['x'\] are not in parameters.properties"),
])
def test_an_invalid_schema_is_refused_naming_the_tool(parameters, message):
    with pytest.raises(ToolSchemaError, match=r"tool 'bad': " + message):
        Tool(name="bad", description="", parameters=parameters, fn=lambda **kw: "")


def _echo_tools():
    def count(n):
        if n < 0:
            raise ValueError("n must be >= 0")
        return "x" * n if n != 7 else 7

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    return {"count": Tool("count", "", schema, count), "calculator": CALCULATOR}


@pytest.mark.parametrize(("call", "observation"), [
    (ToolCall("count", {"n": 3}), ("xxx", True)),
    (ToolCall("cnt", {"n": 3}), ("error: unknown tool 'cnt'; available: calculator, count", False)),
    (ToolCall("count", {}), ("error: count: missing argument 'n'", False)),
    (ToolCall("count", {"n": "3"}), ("error: count: argument 'n' must be integer, got str '3'", False)),
    (ToolCall("count", {"n": True}), ("error: count: argument 'n' must be integer, got bool True", False)),
    (ToolCall("count", {"n": 1, "m": 2}), ("error: count: unexpected argument 'm' (arguments: n)", False)),
    (ToolCall("count", [1]), ("error: count: arguments must be a JSON object, got list", False)),
    (ToolCall("count", {"n": -1}), ("error: count raised ValueError: n must be >= 0", False)),
    (ToolCall("count", {"n": 7}), ("error: count returned int, not text", False)),
    (ToolCall("calculator", {"expression": "1/0"}), ("error: calculator raised ZeroDivisionError: division by zero",
                                                     False)),
])
def test_a_call_gives_an_observation_whatever_the_model_got_wrong(call, observation):
    assert call_tool(_echo_tools(), call) == observation


def test_the_python_tool_refuses_to_start_where_the_sandbox_cannot_run(monkeypatch):
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "the python tool's sandbox needs root")
    with pytest.raises(sandbox.SandboxUnavailable, match="needs root"):
        tools.python_tool()
