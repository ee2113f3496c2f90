"""The base of every config section, and references to user functions (`module:function`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class FunctionRef(Section):
    fn: str  # "package.module:function"
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("fn")
    @classmethod
    def _module_function(cls, value: str) -> str:
        return function_ref(value)


def function_ref(value: str) -> str:
    if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
        raise ValueError(f"{value!r} must look like 'package.module:function'")
    return value
