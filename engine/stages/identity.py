"""A stage's identity: the sha256 of its inputs record (engine/stages/inputs.py), walked field by field.

- A config field's mark (engine/config/base.py `IdentityMark`), declared once on the field, says how
  it enters: `neutral` and `wiring` fields not at all; `file`, `model`, `function` and `kwargs` fields
  by content, not by name.
- Secret keys (engine/config/secrets.py) never enter it.
- An upstream input enters as its identity (its producing stage's manifest, or a content fingerprint).

The tree the hash is taken over is kept with every checkpoint: `changed_keys` compares two of them.
`IDENTITY_FORMAT` is in every tree: a run written before identities were derived this way (no format)
cannot be continued by this rlflow (flows/preflight.py says so before anything runs).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from typing import Any

from pydantic import BaseModel

from rlflow.engine.config.base import IdentityMark, SectionView, identity_mark
from rlflow.engine.config.secrets import SECRET_KEY_PATTERN, diff_keys
from rlflow.engine.data.records import fingerprint_file
from rlflow.engine.errors import ConfigError
from rlflow.engine.models.identity import model_fingerprint
from rlflow.engine.stages.inputs import StageInputs, Upstream

IDENTITY_FORMAT = 2  # 1 (absent): rlflow 0.1, identities of config subtrees listed by hand in flows/rounds.py


class ContentHasher:
    """Fingerprints of what config values name, each computed once: data files (sha256 of the bytes),
    model folders (engine/models/identity.py), the source file of a "module:function", and kwargs
    values that name existing local files."""

    def __init__(self, storage_options: dict[str, Any] | None = None):
        self.storage_options = storage_options or {}
        self._seen: dict[tuple[str, str], str] = {}

    def _once(self, kind: str, key: str, compute: Any) -> str:
        if (kind, key) not in self._seen:
            self._seen[(kind, key)] = compute()
        return self._seen[(kind, key)]

    def file(self, url: str) -> str:
        return self._once("file", url, lambda: "sha256:" + fingerprint_file(url, self.storage_options))

    def model(self, path: str) -> str:
        return self._once("model", path, lambda: model_fingerprint(path))

    def function(self, ref: str, key: str) -> str:
        """`ref` with the sha256 of its module's source file: an edit of that file is a new identity
        (edits of the modules it imports are not seen: docs/checkpoints.md)."""
        return self._once("function", ref, lambda: f"{ref}@sha256:{_module_source_sha256(ref, key)}")

    def kwargs(self, value: Any) -> Any:
        """kwargs with each string that names an existing local file replaced by that file's sha256."""
        if isinstance(value, dict):
            return {k: self.kwargs(v) for k, v in value.items() if not SECRET_KEY_PATTERN.match(str(k))}
        if isinstance(value, (list, tuple)):
            return [self.kwargs(v) for v in value]
        if isinstance(value, str) and os.path.isfile(value):
            return self.file(value)
        return value


def _module_source_sha256(ref: str, key: str) -> str:
    module = ref.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    if not origin or not os.path.isfile(origin):
        raise ConfigError(f"{key}: module {module!r} of {ref!r} cannot be found; check the name and sys.path")
    with open(origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def identity_tree(stage: str, inputs: StageInputs, content: ContentHasher) -> dict[str, Any]:
    """What a stage's identity is the hash of: its inputs record, as described in the module docstring."""
    return {"format": IDENTITY_FORMAT, "stage": stage} | _fields(inputs, content, "")


def identity_of(tree: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()


def _fields(record: BaseModel, content: ContentHasher, where: str) -> dict[str, Any]:
    out = {}
    fields = type(record).model_fields
    for name, field in fields.items():
        key = field.alias or name  # as a config file spells it (rollout.async)
        if SECRET_KEY_PATTERN.match(key):
            continue
        source = type(record).field_of_source(name) if isinstance(record, SectionView) else field
        mark = identity_mark(source)
        if mark is not None and mark.excluded:
            continue
        out[key] = _value(getattr(record, name), mark, content, f"{where}{key}")
    return out


def _value(value: Any, mark: IdentityMark | None, content: ContentHasher, where: str) -> Any:
    if isinstance(value, Upstream):
        return value.identity
    if isinstance(value, BaseModel):
        return _fields(value, content, where + ".")
    if value is None:
        return None
    if mark is not None:
        if mark.kind == "file":
            return content.file(value)
        if mark.kind == "model":
            return content.model(value)
        if mark.kind == "function":
            return content.function(value, where)
        if mark.kind == "kwargs":
            return content.kwargs(value)
    if isinstance(value, (list, tuple)):
        return [_value(v, None, content, f"{where}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        kept = {k: v for k, v in value.items() if not SECRET_KEY_PATTERN.match(str(k))}
        return {k: _value(v, None, content, f"{where}.{k}") for k, v in kept.items()}
    return value


def legacy_message(what: str) -> str:
    """Why a stage (or run) written by rlflow 0.1 cannot be continued, and what to do instead."""
    return (
        f"{what} was written by rlflow 0.1, whose stage identities were lists of config keys kept by hand;"
        " this rlflow derives them from each stage's inputs and cannot tell whether it would compute the same:"
        " start the run again under a new run.name (its checkpoints and MLflow runs stay where they are), or"
        " continue it with rlflow 0.1"
    )


def changed_keys(recorded: dict[str, Any], current: dict[str, Any]) -> tuple[str, ...]:
    """The keys of two identity trees that differ, as a config spells them ("rl.actor_lr",
    "data.prompts"); upstream inputs as "upstream.<name>"."""
    if recorded.get("format") != current.get("format"):
        return (f"(identity format {recorded.get('format', 1)} -> {current.get('format', 1)})",)
    return tuple(diff_keys(recorded, current)) or ("(inputs)",)
