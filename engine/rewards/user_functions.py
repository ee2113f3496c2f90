"""User functions named in the config (`module:function`): gold scores and labellers."""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from rlflow.engine.errors import ConfigError


def load_function(ref: str, key: str) -> Callable[..., Any]:
    """Import `package.module:function`; a ConfigError names the config key when it fails."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}: cannot import module {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no function {attr!r}")
    return fn


def load_bound_function(ref: Any, key: str) -> Callable[..., Any]:
    """A FunctionRef's function with its kwargs bound (gold.fn with gold.kwargs)."""
    fn = load_function(ref.fn, key)
    return functools.partial(fn, **ref.kwargs) if ref.kwargs else fn


@dataclass(frozen=True)
class GoldScores:
    scores: list[float]  # one 0..1 score per answer
    components: dict[str, list[float]]  # optional named parts the function reported


def score_answers(
    fn: Callable[..., Any], prompts: Sequence[str], answers: Sequence[str], fields: Sequence[Mapping[str, Any]]
) -> GoldScores:
    """Call `fn(prompt, response, **fields)` per answer. It may return a float or a mapping with
    "score" and other numeric components; a non-finite score is an error naming the sample."""
    scores: list[float] = []
    components: dict[str, list[float]] = {}
    for i, (prompt, answer, extra) in enumerate(zip(prompts, answers, fields)):
        result = fn(prompt, answer, **extra)
        if isinstance(result, Mapping):
            for name, value in result.items():
                if name != "score":
                    components.setdefault(name, []).append(float(value))
            result = result["score"]
        value = float(result)
        if not math.isfinite(value):
            raise ValueError(f"score function returned {value} for sample {i} (prompt {prompt[:60]!r})")
        scores.append(value)
    return GoldScores(scores, components)
