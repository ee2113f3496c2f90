"""Built-in rule rewards (reward.sources items of type keyword, regex, length, format, exact_match,
and gym: a reasoning-gym verifier, engine/tasksets/gym.py).

Each rule is a builder: called once with the source's `kwargs` (validated there, so a bad config
fails before any sample is scored), it returns a scorer `(prompt, response, fields) -> float`,
where `fields` is the prompt row's other columns (PromptRecord.fields). `RULES` maps the config's
`type` to its builder; the builder's signature is the list of valid kwargs and their defaults.

Pure Python on purpose: the reward pool's worker processes build these and must not import torch.
"""

from __future__ import annotations

import inspect
import json
import re
from decimal import Decimal
from typing import Any, Callable, Mapping

from rlflow.engine.errors import ConfigError
from rlflow.engine.tasksets.gym import gym_rule

Scorer = Callable[[str, str, Mapping[str, Any]], float]

# An int or decimal number, optionally signed, with optional thousands separators ("1,000.5").
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_LAST_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_bool(name: str, value: Any) -> None:
    # YAML "false" in quotes is a non-empty (truthy) string: insist on a real boolean.
    _check(isinstance(value, bool), f"kwargs.{name} must be true or false, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"kwargs.{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float, strict: bool) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and (value > minimum if strict else value >= minimum)
    _check(ok, f"kwargs.{name} must be a number {'>' if strict else '>='} {minimum:g}, got {value!r}")


def _compile(name: str, pattern: Any, flags: int) -> re.Pattern:
    _check(isinstance(pattern, str) and pattern != "", f"kwargs.{name} must be a non-empty string, got {pattern!r}")
    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"kwargs.{name} {pattern!r} is not a valid regular expression ({exc})") from None


def keyword_rule(keywords: list[str], mode: str = "any", ignore_case: bool = True) -> Scorer:
    """Whole-word keyword presence in the response.

    kwargs: keywords (required, non-empty list of strings; a keyword may hold several words),
    mode (any | all | fraction, default any), ignore_case (default true).
    Score: any -> 1.0 if at least one keyword occurs, else 0.0; all -> 1.0 if every keyword occurs;
    fraction -> the share of keywords that occur (0..1). "Whole word": not preceded or followed by a
    letter, digit or '_' ("cat" does not match "concat"; "C++" matches "I like C++.").
    """
    ok = isinstance(keywords, list) and keywords and all(isinstance(k, str) and k.strip() for k in keywords)
    _check(bool(ok), f"kwargs.keywords must be a non-empty list of non-empty strings, got {keywords!r}")
    _check_choice("mode", mode, ("any", "all", "fraction"))
    _check_bool("ignore_case", ignore_case)
    flags = re.IGNORECASE if ignore_case else 0
    patterns = [re.compile(rf"(?<!\w){re.escape(k.strip())}(?!\w)", flags) for k in keywords]

    def score(prompt: str, response: str, fields: Mapping[str, Any]) -> float:
        found = sum(1 for p in patterns if p.search(response))
        if mode == "any":
            return float(found > 0)
        if mode == "all":
            return float(found == len(patterns))
        return found / len(patterns)

    return score


def regex_rule(pattern: str, full_match: bool = False, ignore_case: bool = False) -> Scorer:
    """Whether the response matches a regular expression (Python `re` syntax).

    kwargs: pattern (required; compiled when the config is loaded), full_match (default false: the
    pattern may match anywhere, `re.search`; true: it must match the whole response, `re.fullmatch`),
    ignore_case (default false). Score: 1.0 on a match, else 0.0.
    """
    _check_bool("full_match", full_match)
    _check_bool("ignore_case", ignore_case)
    compiled = _compile("pattern", pattern, re.IGNORECASE if ignore_case else 0)
    match = compiled.fullmatch if full_match else compiled.search

    def score(prompt: str, response: str, fields: Mapping[str, Any]) -> float:
        return float(match(response) is not None)

    return score


def length_rule(target: float, unit: str = "words", tolerance: float = 0) -> Scorer:
    """Closeness of the response's length to a target.

    kwargs: target (required, > 0, in `unit`), unit (words | chars, default words: words are
    whitespace-separated tokens; chars count the stripped response), tolerance (default 0, in
    `unit`). Score: 1.0 when |length - target| <= tolerance, else max(0, 1 - |length - target| /
    target); e.g. target 10 words: 10 -> 1.0, 15 -> 0.5, 0 or >= 20 -> 0.0.
    """
    _check_number("target", target, 0, strict=True)
    _check_choice("unit", unit, ("words", "chars"))
    _check_number("tolerance", tolerance, 0, strict=False)

    def score(prompt: str, response: str, fields: Mapping[str, Any]) -> float:
        length = len(response.split()) if unit == "words" else len(response.strip())
        off = abs(length - target)
        return 1.0 if off <= tolerance else max(0.0, 1.0 - off / target)

    return score


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "nonempty": lambda text: text != "",
    "one_line": lambda text: text != "" and "\n" not in text and "\r" not in text,
    "number": lambda text: _NUMBER_RE.fullmatch(text) is not None,
    "json": _is_json,
}


def format_rule(kind: str = "nonempty") -> Scorer:
    """Whether the response has a given structure; surrounding whitespace is ignored.

    kwargs: kind (default nonempty): nonempty -> anything but whitespace; one_line -> non-empty and
    no line break; number -> the whole response is an int or decimal number ("7", "-3.5", ".5",
    "1,000"; no exponent, no units); json -> parses as JSON (any value: "3" and "[1]" pass too).
    Score: 1.0 if it does, else 0.0.
    """
    _check_choice("kind", kind, tuple(_FORMAT_CHECKS))
    check = _FORMAT_CHECKS[kind]

    def score(prompt: str, response: str, fields: Mapping[str, Any]) -> float:
        return float(check(response.strip()))

    return score


def _normalized(text: str) -> str:
    text = " ".join(text.strip().lower().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def _as_number(text: str) -> Decimal | None:
    return Decimal(text.replace(",", "")) if _NUMBER_RE.fullmatch(text) else None


def exact_match_rule(
    field: str = "answer", extract: str = "full", pattern: str | None = None, normalize: bool = True
) -> Scorer:
    """Whether (part of) the response equals the reference answer in the prompt row's `field`.

    kwargs: field (default "answer": the data column with the reference), extract (full | last_number
    | regex, default full: what of the response is compared; last_number -> the last number in it;
    regex -> `pattern`'s first group, or its whole match if it has no group, first match wins),
    pattern (required with extract regex, else not allowed), normalize (default true: both sides are
    stripped, lowercased, whitespace-collapsed and lose one trailing '.'; when both then read as
    numbers they are compared as numbers, so "7.0" equals "7" and "1,000" equals "1000").
    Score: 1.0 on a match, else 0.0 (also when nothing could be extracted). A row without `field`
    (or with a null there) is an error: the pool applies reward.on_error to it.
    """
    _check(isinstance(field, str) and field != "", f"kwargs.field must be a column name, got {field!r}")
    _check_choice("extract", extract, ("full", "last_number", "regex"))
    _check_bool("normalize", normalize)
    if extract == "regex":
        _check(pattern is not None, "kwargs.pattern is required with extract: regex (its first group is compared)")
        compiled = _compile("pattern", pattern, 0)
    else:
        _check(pattern is None, f"kwargs.pattern is only used with extract: regex, not extract: {extract}")

    def extracted(response: str) -> str | None:
        if extract == "full":
            return response
        if extract == "last_number":
            numbers = _LAST_NUMBER_RE.findall(response)
            return numbers[-1] if numbers else None
        found = compiled.search(response)
        return None if found is None else found.group(1 if compiled.groups else 0)

    def score(prompt: str, response: str, fields: Mapping[str, Any]) -> float:
        if fields.get(field) is None:
            have = ", ".join(sorted(fields)) or "none"
            state = "is null" if field in fields else "is missing"
            raise ValueError(f"field {field!r} {state} in this prompt row (its fields: {have}); set kwargs.field")
        reference, answer = str(fields[field]), extracted(response)
        if answer is None:
            return 0.0
        if not normalize:
            return float(answer == reference)
        reference, answer = _normalized(reference), _normalized(answer)
        ref_number, answer_number = _as_number(reference), _as_number(answer)
        if ref_number is not None and answer_number is not None:
            return float(ref_number == answer_number)
        return float(answer == reference)

    return score


RULES: dict[str, Callable[..., Scorer]] = {
    "keyword": keyword_rule,
    "regex": regex_rule,
    "length": length_rule,
    "format": format_rule,
    "exact_match": exact_match_rule,
    "gym": gym_rule,
}


def make_rule(rule_type: str, kwargs: Mapping[str, Any], source_name: str) -> Scorer:
    """Build reward source `source_name`'s scorer; a ConfigError names the source, the bad kwarg
    and the valid ones, so a typo fails when the config is loaded, not mid-training."""
    builder = RULES.get(rule_type)
    if builder is None:
        raise ConfigError(f"reward source {source_name!r}: unknown rule type {rule_type!r}; valid: {', '.join(RULES)}")
    where = f"reward source {source_name!r} (type {rule_type})"
    params = inspect.signature(builder).parameters
    valid = ", ".join(params)
    for key in kwargs:
        if key not in params:
            raise ConfigError(f"{where}: unknown kwarg {key!r}; valid: {valid}")
    for key, param in params.items():
        if param.default is inspect.Parameter.empty and key not in kwargs:
            raise ConfigError(f"{where}: missing required kwarg {key!r}; valid: {valid}")
    try:
        return builder(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
