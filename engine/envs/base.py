"""What an environment is: `reset(row)` gives the conversation's first messages, `step(text)` answers
a model turn. Single-turn RL is the environment whose first step is done.

A class is named in the config as "package.module:Class" and built with its kwargs; the checks
below run at config time, so a wrong name or signature stops the run before anything is written.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlflow.engine.envs.chat import Message


@dataclass(frozen=True)
class EnvStep:
    observation: list[Message] = field(default_factory=list)
    """Messages appended before the model's next turn (tool results, a user's reply); [] when done."""
    reward: float = 0.0
    """This turn's reward, added to the verifier's reward of the final answer."""
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    """Counts summed over an episode and logged as env/<key> (e.g. tool_calls, tool_errors)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The first messages for a data row: its `prompt` (a string, or the conversation so far as a
        tuple of {role, content} turns) and its other fields."""

    def step(self, assistant_message: str) -> EnvStep:
        """The answer to the model's turn (its text, decoded from the sampled ids)."""


def environment_class(ref: str) -> type:
    """The class "package.module:Class" names, checked to be an Environment; ValueError says what is wrong."""
    module_name, _, name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"env.fn {ref!r}: cannot import {module_name!r} ({exc})") from None
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        raise ValueError(f"env.fn {ref!r}: {module_name} has no class {name!r}")
    for method, params in (("reset", ["row"]), ("step", ["assistant_message"])):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise ValueError(f"env.fn {ref!r}: {name} has no method {method}({', '.join(params)})")
        positional = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # after self
        required = [p for p in positional if p.default is p.empty]
        if len(required) > 1 or not positional:
            raise ValueError(
                f"env.fn {ref!r}: {name}.{method} must take one argument ({params[0]}), "
                f"it takes ({', '.join(p.name for p in positional)})")
    return cls


def build_environment(ref: str, kwargs: dict[str, Any]) -> Environment:
    """An instance of the named class; ValueError when its constructor refuses the kwargs."""
    cls = environment_class(ref)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"env.kwargs do not fit {ref}: {exc}") from None
    return cls(**kwargs)
