"""`rlflow config --help-keys [PREFIX]` | `--markdown`: every config key with its type, default,
constraints and description, read from the schema (engine/config/), so the reference cannot drift
from it. docs/config.md is `rlflow config --markdown`; tests/unit/flows/cli/test_config_keys.py checks it."""

from __future__ import annotations

import argparse
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

REGENERATE = "rlflow config --markdown > docs/config.md"
HEADER = f"""<!-- Generated from the schema (engine/config/): edit a field's docstring there, then run
`{REGENERATE}`. tests/unit/flows/cli/test_config_keys.py fails while they differ. -->

# Config reference

A run's configuration is a YAML file of the sections below (the demo's: `configs/demo.yaml`). Any key
can be overridden on the command line as `key.path=value`, the value read as YAML:
`rlflow run configs/demo.yaml rl.steps=20 "sft.rounds=[0, 2]" kl.stop_above=null`. Every section rejects
unknown keys (the error names the file and line and lists the valid keys), so a typo never falls back
to a default; `rlflow run CONFIG --dry-run` prints the resolved config and the plan.

This page is generated from the schema; `rlflow config --help-keys [PREFIX]` prints the same list
in a terminal. Defaults are shown as YAML writes them, *required* where there is none. A
`{{fn, kwargs}}` is a function reference (`fn: package.module:function` and the keyword arguments it
is called with); a `mapping` holds the keys listed after it (`model.lora.r`), a `list[mapping]` is a
list of such mappings (`reward.sources[].name`).

A stage's identity (docs/checkpoints.md) is the hash of everything that stage reads; a key marked
**Not in identity** never changes one (it says how a stage runs or reports, not what it computes), a
key marked **Wiring** enters only through the upstream input it selects, and a key marked **By content**
enters by what it names (a file's bytes, a model folder's fingerprint, a function's source file), not
by the name itself.

Keys marked **Secret** hold credentials: their values are redacted (`***`) in everything stored or
shown (MLflow params, Prefect parameters, checkpoint metadata, `--dry-run`) and reach the stage
processes only through the environment. Any key named like one, wherever it is (an `api_key` in a
`kwargs` mapping too), is secret: the names are `SECRET_KEY_PATTERN` in `engine/config/secrets.py`.
"""
SEE_ALSO = {
    "model": "[LoRA](lora.md)",
    "algorithm": "[the table of methods](algorithms.md#one-key-to-switch-the-method-ppo-grpo-rloo-reinforce-dpo)",
    "reward": "[Rewards](rewards.md)",
    "checkpoint": "[Checkpoints](checkpoints.md)",
    "safety": "[Guards](guards.md)",
    "alerts": "[Guards](guards.md)",
    "resources": "[Scaling](scaling.md) and `infra/multinode.md`",
    "engine": "[Scaling](scaling.md)",
}
BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


@dataclass(frozen=True)
class KeyRow:
    key: str  # dotted, e.g. kl.target; items of a list of sections: reward.sources[].name
    type: str
    default: str  # as YAML shows it; "required" when there is none
    constraints: str  # e.g. ">= 1, <= 1000"
    description: str
    secret: bool
    identity: str = ""  # how it enters a stage's identity, when not plainly by value (engine/config/base.py)


def _nested(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """(section class, "" | "optional" | "list") of a field holding sub-keys; a FunctionRef is one key."""
    from rlflow.engine.config.base import FunctionRef

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return (None, "") if issubclass(annotation, FunctionRef) else (annotation, "")
    if origin is list and args:
        return (args[0], "list") if _nested(args[0]) == (args[0], "") else (None, "")
    members = [a for a in args if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(members) == 1 and _nested(members[0])[0]:
        return members[0], "optional"
    return None, ""


def walk(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo, bool]]:
    """(dotted key, field, is_leaf) of every field under `model`, in declaration order. A plain nested
    section is no leaf (its keys are); an optional or listed section is one, and its keys follow it."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        section, shape = _nested(info.annotation)
        yield key, info, section is None or shape != ""
        if section is not None:
            yield from walk(section, f"{key}[]." if shape == "list" else f"{key}.")


def undocumented(model: type[BaseModel] | None = None) -> list[str]:
    """Keys (sections included) whose field has no description."""
    return [key for key, info, _ in walk(model or _config()) if not (info.description or "").strip()]


def type_text(annotation: Any) -> str:
    """A readable type: int, float | None, list[str], 'ppo' | 'grpo' for a Literal, {fn, kwargs}."""
    from rlflow.engine.config.base import FunctionRef

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, FunctionRef):
        return "{fn, kwargs}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return "Any" if annotation is Any else getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    """The default as YAML writes it (default factories called); "required" when there is none."""
    import yaml
    from pydantic_core import to_jsonable_python

    if info.is_required():
        return "required"
    value = to_jsonable_python(info.get_default(call_default_factory=True))
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1_000_000).strip()
    return text.removesuffix("...").strip()


def constraints_text(info: FieldInfo) -> str:
    bounds = [f"{sign} {getattr(m, attr)}" for m in info.metadata for attr, sign in BOUNDS if hasattr(m, attr)]
    return ", ".join(bounds)


CONTENT = {
    "file": "the file's bytes",
    "model": "the model folder's fingerprint",
    "function": "the source file of its module",
    "kwargs": "values naming an existing local file count by that file's bytes",
}


def identity_text(info: FieldInfo) -> str:
    from rlflow.engine.config.base import identity_mark

    mark = identity_mark(info)
    if mark is None:
        return ""
    if mark.kind == "neutral":
        return f"Not in identity: {mark.why}."
    if mark.kind == "wiring":
        return f"Wiring: {mark.why}."
    return f"By content: {CONTENT[mark.kind]}."


def key_rows(prefix: str = "") -> list[KeyRow]:
    """One row per leaf key of Config (only those under `prefix`, e.g. "rl" or "kl", if given)."""
    from rlflow.engine.config.secrets import is_secret_path

    rows = []
    for key, info, leaf in walk(_config()):
        if leaf and (not prefix or key == prefix or key.startswith((f"{prefix}.", f"{prefix}[]."))):
            description = " ".join((info.description or "").split())
            secret = is_secret_path(key.replace("[]", "").split("."))
            rows.append(KeyRow(key, type_text(info.annotation), default_text(info), constraints_text(info),
                               description, secret, identity_text(info)))
    return rows


def _code(text: str) -> str:
    """A code span in a table cell: a `|` stays outside the span, escaped (GitHub and mkdocs agree)."""
    return " \\| ".join(f"`{part.strip()}`" for part in text.split("|"))


def _prose(text: str) -> str:
    """Free text in a table cell: code spans kept, `|` `*` `<` escaped outside them."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")
    return "`".join(parts)


def render_markdown() -> str:
    """The reference page: HEADER, then per top-level section a `## name` and a table of its keys."""
    sections: dict[str, list[KeyRow]] = {}
    for row in key_rows():
        sections.setdefault(row.key.split(".")[0].split("[")[0], []).append(row)
    fields = _config().model_fields
    out = [HEADER]
    for name, rows in sections.items():
        intro = "" if rows[0].key == name else " ".join((fields[name].description or "").split())
        see = f" See {SEE_ALSO[name]}." if name in SEE_ALSO else ""
        out += [f"## {name}", ""] + ([_prose(intro) + see, ""] if intro or see else [])
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for r in rows:
            kind = _code(r.type) + (f" ({r.constraints})" if r.constraints else "")
            default = "*required*" if r.default == "required" else _code(r.default)
            text = _prose(r.description) + (" **Secret.**" if r.secret else "")
            if r.identity:
                label, _, why = r.identity.partition(": ")
                text += f" **{label}:** {_prose(why)}"
            out.append(f"| `{r.key}` | {kind} | {default} | {text} |")
        out.append("")
    return "\n".join(out)


def render_text(prefix: str = "") -> str:
    """The keys for a terminal: `key: type (constraints) = default`, the description indented below."""
    lines = []
    for r in key_rows(prefix):
        bounds = f" ({r.constraints})" if r.constraints else ""
        lines.append(f"{r.key}: {r.type}{bounds} = {r.default}")
        text = r.description + (" Secret: redacted wherever it is stored or shown." if r.secret else "")
        text += f" {r.identity}" if r.identity else ""
        lines.append(textwrap.fill(text, 100, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)


def _config() -> type[BaseModel]:
    from rlflow.engine.config.schema import Config

    return Config


def command_config(args: argparse.Namespace) -> int:
    from rlflow.engine.errors import ConfigError

    if args.markdown:
        print(render_markdown(), end="")
        return 0
    if not key_rows(args.help_keys):
        sections = ", ".join(_config().model_fields)
        raise ConfigError(f"no config key under {args.help_keys!r}; the top-level keys: {sections}")
    print(render_text(args.help_keys))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="the config reference: every key's type, default and meaning")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--help-keys", nargs="?", const="", metavar="PREFIX",
                      help="list every key (only those under PREFIX if given, e.g. rl or kl)")
    what.add_argument("--markdown", action="store_true", help="print the reference page (docs/config.md)")
    p.set_defaults(handler=command_config)
