"""The base of every config section, the fields the supervised stages share, a check for names chosen
from a table, and references to user functions (`module:function`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    # use_attribute_docstrings: the string under each field is its description, the one source of
    # the config reference (`rlflow config --markdown` writes docs/config.md from it).
    # serialize_by_alias: a key that is a Python keyword (rollout.async) is dumped as typed.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True, serialize_by_alias=True
    )


class SupervisedSection(Section):
    """The optimizer and sequence fields SFT, the reward model and DPO share (each sets its own lr and
    warmup_steps): AdamW at a peak lr with linear warmup, then cosine decay to 10% of it at the last step."""

    batch_size: int = Field(32, ge=1)
    """Rows per optimizer step (SFT: sequences; reward model, DPO: pairs), over all ranks and micro-batches."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm."""
    max_seq_tokens: int = Field(128, ge=8)
    """Token limit of prompt + response per sequence (the prompt keeps its last tokens)."""


def one_of(valid: tuple[str, ...], key: str) -> AfterValidator:
    """A field's check (`Annotated[str, one_of(...)]`) that its value is a name in `valid`; the error names
    the key, the value and the valid names."""

    def check(value: str) -> str:
        if value not in valid:
            raise ValueError(f"unknown {key} {value!r}; valid: {', '.join(valid)}")
        return value

    return AfterValidator(check)


class FunctionRef(Section):
    """A user function: `fn` and the keyword arguments it is called with."""

    fn: str
    """The function, as "package.module:function"."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to every call of `fn`."""

    @field_validator("fn")
    @classmethod
    def _module_function(cls, value: str) -> str:
        return function_ref(value)


def function_ref(value: str) -> str:
    if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
        raise ValueError(f"{value!r} must look like 'package.module:function'")
    return value
