"""The `env` section: the environment a multi-turn (tool-using) RL stage runs each prompt in.

Without it the RL stage is single-turn, as it always was. The class, its kwargs and its tools are
checked when the config loads (one instance is built and thrown away), so a wrong name, signature
or tool schema stops the run before anything is written.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from rlflow.engine.config.base import Section, by_content, neutral
from rlflow.engine.envs.base import build_environment


class EnvConfig(Section):
    fn: Annotated[str, by_content("function")]
    """The environment class, as "package.module:Class" (reset(row) -> messages, step(text) -> EnvStep;
    engine/envs/base.py). The built-in tool environment: rlflow.engine.envs.tool_env:ToolEnv."""
    kwargs: Annotated[dict[str, Any], by_content("kwargs")] = Field(default_factory=dict)
    """Keyword arguments of the class (ToolEnv: tools, parser, system)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode; an episode still calling tools after the last is truncated (no answer)."""
    max_total_tokens: int = Field(256, ge=1)
    """Every token after the prompt, the model's turns and the observations together; each turn also
    stops at sampling.max_new_tokens."""
    tool_workers: Annotated[int, neutral("a thread count: how the tools run, not what they return")] = Field(
        4, ge=1, le=256
    )
    """Threads that run the environments' steps (tool calls) beside the batch's generation."""

    @field_validator("fn")
    @classmethod
    def _module_class(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
            raise ValueError(f"{value!r} must look like 'package.module:Class'")
        return value

    @model_validator(mode="after")
    def _buildable(self) -> EnvConfig:
        try:
            build_environment(self.fn, self.kwargs)
        except Exception as exc:  # the class's own refusal (an invalid tool schema, no sandbox) included
            message = " ".join(str(exc).split())
            raise ValueError(message if message.startswith("env.") else f"env {self.fn}: {message}") from None
        return self
