"""Real tasks with verifiers nobody here wrote: reasoning-gym's generators and `score_answer`.

`write_gym_dataset` writes prompt files (train and held-out from seeds 10**6 apart, held-out
questions deduplicated against training ones) whose rows carry what the verifier needs:
`answer`, `gym_dataset`, `gym_config`, `gym_question` and `gym_metadata`. `gym_rule` is the
reward source type `gym`; `gym_gold` is the gold function (accuracy, mean score, lenient accuracy).

How an answer is taken from a response (`extract`):
- answer_tag: the text inside the last <answer>...</answer> (whitespace stripped);
- last_number: the last number in the response (as the exact_match rule finds it);
- full: the whole response, stripped.
No extractable answer is a malformed response: the verifier is not called.

reasoning-gym gives partial credit (e.g. 0.01 for any non-empty wrong answer, len(oracle) /
len(answer) for a near miss): *accuracy* counts only score_answer == 1.0; the mean score is
reported beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
from collections.abc import Mapping
from typing import Any, Callable

from rlflow.engine.errors import ConfigError

HELDOUT_SEED_OFFSET = 10**6  # item i of seed s is item 0 of seed s + i: keep the two sets far apart
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
INSTRUCTIONS = {
    "answer_tag": "Give your final answer inside <answer></answer> tags.",
    "last_number": "Answer with the number only.",
    "full": "Reply with the final answer only.",
}


class MalformedAnswer(ValueError):
    """The response holds no answer in the expected format."""


def extract_answer(response: str, extract: str) -> str | None:
    """The answer part of a response (see the module docstring), or None."""
    if extract == "answer_tag":
        found = _ANSWER_TAG.findall(response)
        return found[-1].strip() if found and found[-1].strip() else None
    if extract == "last_number":
        numbers = _NUMBER.findall(response)
        return numbers[-1].replace(",", "") if numbers else None
    if extract == "full":
        return response.strip() or None
    raise ValueError(f"unknown extract {extract!r}; valid: {', '.join(INSTRUCTIONS)}")


def _datasets() -> dict[str, tuple[type, type]]:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def check_dataset(name: str, config: Mapping[str, Any]) -> None:
    """ConfigError unless `name` is a reasoning-gym dataset that accepts `config` (its own checks)."""
    datasets = _datasets()
    if name not in datasets:
        raise ConfigError(f"unknown gym dataset {name!r}; valid: {', '.join(sorted(datasets))}")
    config_cls = datasets[name][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = [k for k in config if k not in valid]
    if unknown:
        raise ConfigError(
            f"gym dataset {name!r} has no config key {unknown[0]!r}; valid: {', '.join(valid)}"
        )
    try:
        config_cls(**config).validate()
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"gym dataset {name!r} rejects config {dict(config)}: {exc or type(exc).__name__}") from None


def _entries(name: str, size: int, seed: int, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    import reasoning_gym

    return list(reasoning_gym.create_dataset(name, size=size, seed=seed, **config))


def gym_rows(entries: list[dict[str, Any]], name: str, config: Mapping[str, Any], instruction: str) -> list[dict]:
    """Prompt rows: the question and the answer-format instruction, plus what the verifier needs."""
    return [
        {
            "prompt": f"{e['question'].rstrip()}\n{instruction}" if instruction else e["question"],
            "answer": str(e["answer"]),
            "gym_dataset": name,
            "gym_config": dict(config),
            "gym_question": e["question"],
            "gym_metadata": json.loads(json.dumps(e.get("metadata", {}), default=str)),
        }
        for e in entries
    ]


def demonstration(answer: str, extract: str) -> str:
    """A verified SFT response in the answer format `extract` reads."""
    return f"<answer>{answer}</answer>" if extract == "answer_tag" else answer


DEMONSTRATION_TOOLS = ("python",)
_ARITHMETIC = re.compile(r"([-+*/().\d\s]*\d[-+*/().\d\s]*)=\s*$")  # "...: 15 - 43 =" -> "15 - 43 "


def python_demonstration(row: Mapping[str, Any], extract: str, flaw: str | None = None,
                         rng: random.Random | None = None) -> dict[str, Any]:
    """An SFT row that uses the `python` tool (engine/envs/tools.py) on an arithmetic question ending
    in "<expression> =" (chain_sum, basic_arithmetic): the question, a call that prints the
    expression, the tool's output, then the answer. The output is the calculator's value of the
    expression (what `print` writes for it), which must equal the dataset's answer. A sloppy
    annotator's `flaw` (drawn from `rng`): "guess" answers a wrong number with no call; "mistype"
    calls with one digit of one operand changed and answers what the tool printed. Raises
    ConfigError naming the question where it ends in no expression or the values differ."""
    from rlflow.engine.envs.tools import calculator, python_tool

    found = _ARITHMETIC.search(row["gym_question"])
    if found is None:
        raise ConfigError(
            f"--tool python: {row['gym_dataset']}'s question {row['gym_question']!r} does not end in an arithmetic "
            "expression and '='; tool demonstrations exist for chain_sum and basic_arithmetic")
    expression = " ".join(found.group(1).split())
    value = calculator(expression)
    if value != row["answer"]:
        raise ConfigError(f"--tool python: {expression} gives {value}, but the dataset's answer is {row['answer']}")
    user, tools = {"role": "user", "content": row["prompt"]}, [python_tool().schema()]
    if flaw == "guess":
        wrong = str(int(value) + rng.choice((-10, -2, -1, 1, 2, 10)))
        return {"messages": [user, {"role": "assistant", "content": demonstration(wrong, extract)}], "tools": tools}
    if flaw == "mistype":
        numbers = list(re.finditer(r"\d+", expression))
        hit = rng.choice(numbers)
        expression = expression[: hit.start()] + _mistyped(hit.group(), rng) + expression[hit.end():]
        value = calculator(expression)
    call = {"name": "python", "arguments": {"code": f"print({expression})"}}
    messages = [
        user,
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": demonstration(value, extract)},
    ]
    return {"messages": messages, "tools": tools}


def _mistyped(number: str, rng: random.Random) -> str:
    """The number with one digit replaced by another (a leading digit stays non-zero). Unlike the
    calculator demo's `mistype`, a one-digit number may become 0: chain_sum's terms may be 0."""
    i = rng.randrange(len(number))
    digit = rng.choice([d for d in "0123456789" if d != number[i] and (i or d != "0" or len(number) == 1)])
    return number[:i] + digit + number[i + 1:]


def _flaw(rng: random.Random, flawed: float) -> str | None:
    """None (a correct demonstration), else the flaw: 3 in 5 flawed demonstrations guess."""
    roll = rng.random()
    return None if roll >= flawed else ("guess" if roll < 0.6 * flawed else "mistype")


def write_gym_dataset(
    name: str,
    out_dir: str,
    size: int,
    eval_size: int,
    seed: int,
    config: Mapping[str, Any] | None = None,
    extract: str = "answer_tag",
    instruction: str | None = None,
    tool: str | None = None,
    flawed: float = 0.0,
) -> dict[str, Any]:
    """prompts.jsonl (train), eval_prompts.jsonl (held-out, seed + 10**6, distinct questions none
    of which is in training) and sft.jsonl / sft_eval.jsonl (verified demonstrations of the same
    prompts; with `tool`, conversations that call it: python_demonstration, a `flawed` share of
    them from a sloppy annotator) under `out_dir`. Returns the counts and paths."""
    config = dict(config or {})
    check_dataset(name, config)
    if extract not in INSTRUCTIONS:
        raise ConfigError(f"unknown extract {extract!r}; valid: {', '.join(INSTRUCTIONS)}")
    if tool is not None and tool not in DEMONSTRATION_TOOLS:
        raise ConfigError(f"unknown demonstration tool {tool!r}; valid: {', '.join(DEMONSTRATION_TOOLS)}")
    if not 0.0 <= flawed <= 1.0 or (flawed and tool is None):
        raise ConfigError(f"--flawed {flawed}: a share in [0, 1] of --tool demonstrations; it needs --tool")
    instruction = INSTRUCTIONS[extract] if instruction is None else instruction
    train = _entries(name, size, seed, config)
    seen = {e["question"] for e in train}
    heldout = []  # distinct questions, none of them in training
    for e in _entries(name, eval_size * 4 + 64, seed + HELDOUT_SEED_OFFSET, config):
        if e["question"] not in seen and len(heldout) < eval_size:
            seen.add(e["question"])
            heldout.append(e)
    if len(heldout) < eval_size:
        raise ConfigError(
            f"gym dataset {name!r} with {config} has too few distinct questions: {len(heldout)} held-out ones"
            f" are not in the {size} training ones (wanted {eval_size}); raise its difficulty"
        )
    files = {
        "prompts": gym_rows(train, name, config, instruction),
        "eval_prompts": gym_rows(heldout, name, config, instruction),
    }
    annotator = random.Random(seed)

    def demonstrate(r: dict[str, Any]) -> dict[str, Any]:
        if tool is not None:
            return python_demonstration(r, extract, _flaw(annotator, flawed), annotator)
        return {"prompt": r["prompt"], "response": demonstration(r["answer"], extract)}

    files["sft"] = [demonstrate(r) for r in files["prompts"]]
    files["sft_eval"] = [demonstrate(r) for r in files["eval_prompts"]]
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for key, rows in files.items():
        paths[key] = os.path.join(out_dir, f"{key}.jsonl")
        with open(paths[key], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return {"dataset": name, "config": config, "train": len(train), "heldout": len(heldout), "paths": paths}


@functools.lru_cache(maxsize=64)
def _verifier(name: str, config_json: str) -> Callable[[Any, dict], float]:
    datasets = _datasets()
    if name not in datasets:
        raise ValueError(f"unknown gym dataset {name!r} in this prompt row")
    dataset_cls, config_cls = datasets[name]
    return dataset_cls(config=config_cls(**json.loads(config_json))).score_answer


def verify(response: str, fields: Mapping[str, Any], extract: str) -> float:
    """score_answer of the extracted answer (0..1). Raises MalformedAnswer when nothing could be
    extracted, KeyError when the row lacks the gym columns, and whatever the verifier raises."""
    missing = [k for k in ("answer", "gym_dataset") if fields.get(k) is None]
    if missing:
        raise KeyError(f"prompt row has no {missing[0]!r} column; write prompts with `rlflow data gym`")
    answer = extract_answer(response, extract)
    if answer is None:
        raise MalformedAnswer(f"no answer in the {extract} format")
    entry = {"question": fields.get("gym_question", ""), "answer": fields["answer"]}
    entry["metadata"] = fields.get("gym_metadata") or {}
    verifier = _verifier(str(fields["gym_dataset"]), json.dumps(fields.get("gym_config") or {}, sort_keys=True))
    return float(verifier(answer, entry))


def gym_rule(extract: str = "answer_tag", credit: str = "exact") -> Callable[[str, str, Mapping[str, Any]], float]:
    """Reward source type `gym`: the row's reasoning-gym verifier on the extracted answer.

    kwargs: extract (answer_tag | last_number | full, default answer_tag), credit (exact | partial,
    default exact: 1.0 only when score_answer is 1.0; partial: score_answer's own 0..1 value).
    A malformed response, a verifier that raises and one that times out are failed calls: a gym
    source skips them (scores 0, counts reward/<name>/skipped) unless its on_error says fail."""
    if extract not in INSTRUCTIONS:
        raise ValueError(f"kwargs.extract must be one of {', '.join(INSTRUCTIONS)}, got {extract!r}")
    if credit not in ("exact", "partial"):
        raise ValueError(f"kwargs.credit must be one of exact, partial, got {credit!r}")

    def score(prompt: str, response: str, fields: Mapping[str, Any]) -> float:
        value = verify(response, fields, extract)
        return value if credit == "partial" else float(value == 1.0)

    return score


def gym_gold(prompt: str, response: str, extract: str = "answer_tag", **fields: Any) -> dict[str, float]:
    """Gold score of one answer: accuracy (score_answer == 1.0) as the score, and the components
    mean_score (score_answer itself), lenient (accuracy of the last number in the response, whatever
    the format) and valid (an answer in the expected format was found). A verifier that raises
    counts as wrong."""

    def graded(how: str) -> float | None:
        try:
            return verify(response, fields, how)
        except MalformedAnswer:
            return None
        except Exception:  # noqa: BLE001 - a verifier's bug grades this answer 0, never the run
            return 0.0

    strict, lenient = graded(extract), graded("last_number")
    return {
        "score": float(strict == 1.0),
        "mean_score": strict or 0.0,
        "lenient": float(lenient == 1.0),
        "valid": float(strict is not None),
    }


def gym_labeller(
    prompt: str, answer_a: str, answer_b: str, *, rng: Any = None, extract: str = "answer_tag", **fields: Any
) -> int | None:
    """Online label of a pair by the dataset's own verifier (label.labeller): 0 if only answer_a
    is right (score_answer == 1.0), 1 if only answer_b is, None (a tie, dropped) if both or
    neither are. Partial credit is not a preference: "closer to the answer" is the verifier's
    heuristic, not correctness. Takes no noise, so `rng` is unused."""
    a, b = (gym_gold(prompt, answer, extract, **fields)["score"] for answer in (answer_a, answer_b))
    if a == b:
        return None
    return 0 if a > b else 1
