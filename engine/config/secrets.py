"""Secret values in config trees: which keys are secret, redacting them, and merging them back.

Secrets travel beside a redacted config (in $RLFLOW_SECRETS), never inside anything stored: MLflow
params, Prefect parameters, worker specs, checkpoint metadata.
"""

from __future__ import annotations

import copy
import re
from urllib.parse import urlsplit, urlunsplit
from typing import Any

from pydantic import BaseModel

# The config's secret values as a JSON tree, handed from the CLI to the flow and from a task to its
# stage processes in the environment: never in a file, argv, a flow parameter or MLflow.
SECRETS_ENV = "RLFLOW_SECRETS"

# Whole key names (or their last "_" part): "hf_token" is secret, "max_new_tokens" is not.
SECRET_KEY_PATTERN = re.compile(
    r"^(.*_)?(secret|token|password|passwd|credentials?|access_key|secret_key|api_key|auth|storage_options|webhook_url|headers)$",
    re.IGNORECASE,
)
REDACTED = "***"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": value}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value and not SECRET_KEY_PATTERN.match(str(key)):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def redact(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of a nested config tree with every secret-looking key's value replaced by '***'."""
    return split_secrets(tree)[0]


def split_secrets(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tree with secret values redacted, a tree holding only the secret values)."""
    public, secret = {}, {}
    for key, value in tree.items():
        if SECRET_KEY_PATTERN.match(str(key)) and value not in (None, {}, ""):
            public[key], secret[key] = REDACTED, value
        elif isinstance(value, dict):
            public[key], inner = split_secrets(value)
            if inner:
                secret[key] = inner
        else:
            public[key] = value
    return public, secret


def merge_trees(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `extra`'s leaves written over it (inverse of split_secrets)."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_trees(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def redacted_dict(config: BaseModel) -> dict[str, Any]:
    return redact(config.model_dump(mode="json"))


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Flattened keys whose values differ between two config trees (secret values never shown)."""
    a, b = flatten(old), flatten(new)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def is_secret_path(path: tuple[Any, ...] | list[Any]) -> bool:
    """Whether a config key path (e.g. ["run", "storage_options", "key"]) leads through a secret."""
    return any(SECRET_KEY_PATTERN.match(str(part)) for part in path)


def redact_override(text: str) -> str:
    """An `a.b=c` override as it may be shown or stored: the value hidden when its key is secret."""
    key = text.split("=", 1)[0]
    return f"{key}={REDACTED}" if "=" in text and is_secret_path(key.strip().split(".")) else text


def secret_strings(tree: Any) -> list[str]:
    """Every leaf of a tree of secret values, as text, longest first (so no mask leaves part of a
    longer one); leaves under 4 characters are skipped: masking them would garble ordinary words."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for child in node.values():
                walk(child)
        elif isinstance(node, (list, tuple)):
            for child in node:
                walk(child)
        elif node is not None and len(str(node)) >= 4:
            found.add(str(node))

    walk(tree)
    return sorted(found, key=len, reverse=True)


def shown_url(url: str) -> str:
    """A URL without user info and query: either may hold a token."""
    parts = urlsplit(url)
    if "@" not in parts.netloc and not parts.query:
        return url  # as given: urlunsplit would turn sqlite:////abs/path into sqlite://abs/path
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=("***@" if "@" in parts.netloc else "") + host, query=""))


def redact_url(url: str) -> str:
    """The URL without credentials (user:password@), for every message that prints it."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = f"***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
