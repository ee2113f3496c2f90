"""A config file as YAML text: its bytes decoded, parsed, and the line of every key, so that
config errors can say "file:line" (the validation itself is in config.py).

Every failure is a one-line ConfigError naming the file and, where known, the line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rlflow.engine.errors import ConfigError


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Key path -> 1-based line of that key in the YAML text (parsed already: it composes)."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    lines[path + (key.value,)] = key.start_mark.line + 1
                    walk(value, path + (key.value,))

    walk(yaml.compose(text, Loader=yaml.SafeLoader), ())
    return lines


def locator(path: Path, text: str, overrides: list[str] | tuple[str, ...]) -> Callable[[tuple[Any, ...]], str]:
    """"file:line" of the key an error is about; a key an override touched has no line in the file."""
    lines = _key_lines(text)
    touched = [tuple(override.split("=", 1)[0].strip().split(".")) for override in overrides]

    def locate(loc: tuple[Any, ...]) -> str:
        keys = tuple(str(p) for p in loc)
        if any(o[: len(keys)] == keys or keys[: len(o)] == o for o in touched):
            return f"{path} (with overrides)"
        found = next((lines[keys[:n]] for n in range(len(keys), 0, -1) if keys[:n] in lines), None)
        return f"{path}:{found}" if found else str(path)

    return locate


def read_text(path: Path) -> str:
    """The file as UTF-8 text; a bad byte is reported by line and byte, as an editor shows them."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(
            f"{path}:{line}: byte {column} of the line (0x{data[e.start]:02x}) is not valid UTF-8;"
            " re-save the config as UTF-8"
        ) from None


def parse_yaml(path: Path, text: str) -> Any:
    """yaml.safe_load, its errors (and the ValueError of a date like 2024-13-45) as ConfigError."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc
        if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow
            line = f":{text.count(chr(10), 0, exc.position) + 1}"
            code = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
            problem = f"{exc.reason}: {code}"
        problem = " ".join(str(problem).split())
        raise ConfigError(f"{path}{line}: not valid YAML ({problem}); fix the syntax there") from None
    except (ValueError, RecursionError) as exc:  # PyYAML builds dates; nesting deeper than the stack
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())[:120]}); quote the value") from None
