"""The base of every config section, the fields the supervised stages share, a check for names chosen
from a table, references to user functions (`module:function`), the marks that say how a field
enters a stage's identity, and views: the part of a section one stage reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class IdentityMark:
    """How a config field enters the identity of a stage whose inputs hold it (engine/stages/identity.py),
    declared once, on the field (`Annotated[int, neutral("...")]`), and shown in the config reference.

    neutral: never: how a stage runs or reports, not what it computes (the reason is `why`);
    wiring: never directly: the flow reads it to connect stages, and what it selects enters the
    stage's identity as an upstream input, by content;
    file, model, function, kwargs: by content, not by name (a file's bytes; a model folder's
    fingerprint; the source file of a "module:function"; kwargs values that name existing files)."""

    kind: Literal["neutral", "wiring", "file", "model", "function", "kwargs"]
    why: str = ""

    @property
    def excluded(self) -> bool:
        return self.kind in ("neutral", "wiring")


def neutral(why: str) -> IdentityMark:
    return IdentityMark("neutral", why)


def wiring(why: str) -> IdentityMark:
    return IdentityMark("wiring", why)


def by_content(kind: Literal["file", "model", "function", "kwargs"]) -> IdentityMark:
    return IdentityMark(kind)


def identity_mark(field: FieldInfo) -> IdentityMark | None:
    return next((m for m in field.metadata if isinstance(m, IdentityMark)), None)


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


class SectionView(Section):
    """The fields of a config section that one stage reads, with the section's own types and identity
    marks: `class PromptData(SectionView, source=DataConfig)` declaring `prompts: str` and so on (a
    name or type the source does not have fails at import). `of(section)` takes them from a section."""

    source: ClassVar[type[Section]]

    def __init_subclass__(cls, source: type[Section] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if source is None:
            raise TypeError(f"{cls.__name__}: a view names its section: class {cls.__name__}(SectionView, source=...)")
        cls.source = source

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, field in cls.model_fields.items():
            theirs = cls.source.model_fields.get(name)
            if theirs is None or theirs.annotation != field.annotation:  # the marks are read from the source
                raise TypeError(f"{cls.__name__}.{name} is not a field of {cls.source.__name__} with the same type")

    @classmethod
    def of(cls, section: Section):
        return cls(**{name: getattr(section, name) for name in cls.model_fields})

    @classmethod
    def field_of_source(cls, name: str) -> FieldInfo:
        return cls.source.model_fields[name]


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

    fn: Annotated[str, by_content("function")]
    """The function, as "package.module:function"."""
    kwargs: Annotated[dict[str, Any], by_content("kwargs")] = Field(default_factory=dict)
    """Keyword arguments bound to every call of `fn`."""

    @field_validator("fn")
    @classmethod
    def _module_function(cls, value: str) -> str:
        return function_ref(value)


def function_ref(value: str) -> str:
    if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", value):
        raise ValueError(f"{value!r} must look like 'package.module:function'")
    return value
