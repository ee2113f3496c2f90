"""Tools a model may call: a Python function with the JSON schema the chat template is given, and
the call's checks. Every mistake of the model (unknown tool, arguments that break the schema, a
tool that raises or answers with something other than text) comes back as an error observation
for it to read; only a tool defined wrongly (an invalid schema) is the user's error.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlflow.engine.envs import sandbox

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


class ToolSchemaError(ValueError):
    """A tool's schema is not a function schema the chat templates accept; names the tool and key."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """A JSON schema of type object: `properties` (each with a `type`) and `required`."""
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        check_parameters(self.name, self.parameters)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF function schema, as `apply_chat_template(..., tools=[...])` takes it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def check_parameters(name: str, parameters: Any) -> None:
    """Raises ToolSchemaError unless `parameters` is an object schema whose properties have JSON types."""
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolSchemaError(f"tool {name!r}: parameters must be a JSON schema with type 'object', got {parameters!r}")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ToolSchemaError(f"tool {name!r}: parameters.properties must be a mapping of argument name to schema")
    for arg, spec in properties.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind not in JSON_TYPES:
            raise ToolSchemaError(
                f"tool {name!r}: argument {arg!r} has type {kind!r}; valid: {', '.join(JSON_TYPES)}")
    required = parameters.get("required", [])
    missing = [r for r in required if r not in properties] if isinstance(required, list) else [required]
    if missing:
        raise ToolSchemaError(f"tool {name!r}: required {missing} are not in parameters.properties")


def argument_errors(tool: Tool, arguments: Any) -> list[str]:
    """What is wrong with a call's arguments against the tool's schema ([] when nothing)."""
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    properties = tool.parameters.get("properties", {})
    errors = [f"missing argument {r!r}" for r in tool.parameters.get("required", []) if r not in arguments]
    for arg, value in arguments.items():
        if arg not in properties:
            errors.append(f"unexpected argument {arg!r} (arguments: {', '.join(properties) or 'none'})")
            continue
        kind = properties[arg]["type"]
        is_bool = isinstance(value, bool)
        if not isinstance(value, JSON_TYPES[kind]) or (is_bool and kind in ("integer", "number")):
            errors.append(f"argument {arg!r} must be {kind}, got {type(value).__name__} {value!r}"[:200])
    return errors


def call_tool(tools: dict[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """Runs one call; returns (the observation text, whether it succeeded)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", False
    errors = argument_errors(tool, call.arguments)
    if errors:
        return f"error: {call.name}: " + "; ".join(errors), False
    try:
        result = tool.fn(**call.arguments)
    except Exception as exc:  # the model's call broke the tool: it reads why
        return f"error: {call.name} raised {type(exc).__name__}: {exc}"[:500], False
    if not isinstance(result, str):
        return f"error: {call.name} returned {type(result).__name__}, not text", False
    return result, True


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_DIGITS = 100


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}: use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Arithmetic on numbers (+ - * / // % ** and parentheses), evaluated without eval: the expression
    is parsed and only those nodes are computed. An exact float prints as an integer."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return str(value)


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression exactly, e.g. '1234 * 5678'.",
    parameters={"type": "object", "properties": {"expression": {"type": "string", "description": "the expression"}},
                "required": ["expression"]},
    fn=calculator,
)


def python_tool(limits: sandbox.SandboxLimits = sandbox.SandboxLimits()) -> Tool:
    """The `python` tool: runs the code in the sandbox (engine/envs/sandbox.py) and answers with what
    it printed. Raises SandboxUnavailable, with the reason, where the sandbox cannot run here."""
    reason = sandbox.unavailable_reason()
    if reason:
        raise sandbox.SandboxUnavailable(reason)

    def python(code: str) -> str:
        return sandbox.run_python(code, limits).describe()

    return Tool(
        name="python",
        description="Run a Python 3 script (standard library only, no network, no files outside its folder) "
                    "and return what it prints.",
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "the script"}},
                    "required": ["code"]},
        fn=python,
    )
