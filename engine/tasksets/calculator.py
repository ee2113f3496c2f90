"""A tool-use demo task: sums and products of 3-4 digit numbers ("what is 4821 * 377 ?"), which a
tiny model cannot work out from memory, with the built-in calculator tool (engine/envs/tools.py).

A good episode calls the calculator with the prompt's expression, reads the result and answers
with it. The SFT demonstrations come from a sloppy annotator: a share of them skip the tool and
guess (GUESS_SHARE: the leading digits right, the rest made up), and a share pass a mistyped
operand and trust what comes back (WRONG_ARGUMENTS_SHARE). A policy trained on them does the same,
sampled at temperature 1, and only the episodes that call with the right arguments are right: that
is the headroom GRPO on the exact-match verifier recovers.

Each demonstration is one SFT row, the whole conversation with the calculator's schema in `tools`:
SFT learns both assistant turns (the call; the answer after the tool's result) on the ids an
episode lays out (engine/data/batching.py encode_conversation). Held-out problems never appear in
the training files.

Run `rlflow demo-assets --task tools` to write the assets (deterministic, a few seconds).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rlflow.engine.envs.chat import render_prompt
from rlflow.engine.envs.tools import CALCULATOR, calculator
from rlflow.engine.tasksets.demo import make_chat_tokenizer, make_tiny_model, write_jsonl

# A 4-digit and a 3-digit operand, in that order: every prompt has the same length, so each digit
# of a call sits at a fixed distance from the prompt digit it copies (a tiny model learns that fast).
OPERANDS = ((1000, 9999), (100, 999))
OPERATORS = ("+", "*")
PROMPT_TEMPLATE = "what is {a} {op} {b} ?"
GUESS_SHARE = 0.3  # demonstrations that answer without the tool
WRONG_ARGUMENTS_SHARE = 0.2  # demonstrations that call it with one operand digit mistyped
DEFAULT_DIR = "demo_assets/tools"
ASSETS_VERSION = 2  # 2: one SFT row per demonstration (1: one per assistant turn)

Problem = tuple[int, str, int]


def expression(problem: Problem) -> str:
    a, op, b = problem
    return f"{a} {op} {b}"


def call_text(expr: str) -> str:
    """A calculator call in the Hermes form the `hermes` parser reads."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "</tool_call>"


def gold_score(prompt: Any, response: str, **fields: Any) -> dict[str, float]:
    """1.0 when the final answer is the row's `answer`, as digits ("4821" or " 4821 "; not "4,821").
    `valid`: the answer is a whole number at all."""
    text = response.strip()
    return {"score": float(text == str(fields.get("answer", ""))), "valid": float(text.lstrip("-").isdigit())}


def guess(answer: int, rng: random.Random) -> int:
    """An estimate that is never the answer: its leading half of the digits, the rest made up."""
    digits = str(answer)
    keep = max(1, len(digits) // 2)
    while True:
        value = int(digits[:keep] + "".join(rng.choice("0123456789") for _ in digits[keep:]))
        if value != answer:
            return value


def mistype(number: int, rng: random.Random) -> int:
    """The number with one digit replaced by another (the leading digit stays non-zero)."""
    digits = list(str(number))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0")])
    return int("".join(digits))


def demonstration(problem: Problem, rng: random.Random) -> list[dict[str, str]]:
    """The annotator's whole conversation for a problem: a guess, or a call and the answer it got."""
    a, op, b = problem
    user = {"role": "user", "content": PROMPT_TEMPLATE.format(a=a, op=op, b=b)}
    roll = rng.random()
    if roll < GUESS_SHARE:
        return [user, {"role": "assistant", "content": str(guess(int(calculator(expression(problem))), rng))}]
    if roll < GUESS_SHARE + WRONG_ARGUMENTS_SHARE:
        a, b = (mistype(a, rng), b) if rng.random() < 0.5 else (a, mistype(b, rng))
    expr = expression((a, op, b))
    result = calculator(expr)
    return [user, {"role": "assistant", "content": call_text(expr)}, {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]


def sft_row(conversation: list[dict[str, str]]) -> dict[str, Any]:
    """The demonstration as one row with the calculator's schema: SFT learns each assistant turn."""
    return {"messages": conversation, "tools": [CALCULATOR.schema()]}


def draw_problems(rng: random.Random, n: int, exclude: set[Problem]) -> list[Problem]:
    """n distinct problems, none of them in `exclude`."""
    (low_a, high_a), (low_b, high_b) = OPERANDS
    chosen: list[Problem] = []
    seen = set(exclude)
    while len(chosen) < n:
        problem = (rng.randint(low_a, high_a), rng.choice(OPERATORS), rng.randint(low_b, high_b))
        if problem not in seen:
            seen.add(problem)
            chosen.append(problem)
    return chosen


def prompt_row(problem: Problem) -> dict[str, str]:
    a, op, b = problem
    return {"prompt": PROMPT_TEMPLATE.format(a=a, op=op, b=b), "answer": calculator(expression(problem))}


def make_tokenizer(rng: random.Random):
    """The demo's byte-level chat tokenizer, digits split, its merges learned from the task's own text
    (the rendered tool instructions, prompts, calls and results)."""
    probe = make_chat_tokenizer(["0123456789"], vocab_size=300, split_digits=True)
    problems = draw_problems(rng, 200, set())
    texts = [render_prompt(probe, [{"role": "user", "content": prompt_row(p)["prompt"]}], [CALCULATOR.schema()])
             for p in problems]
    texts += [call_text(expression(p)) for p in problems] + ["tool", "assistant", "0123456789"]
    return make_chat_tokenizer(texts, vocab_size=400, split_digits=True)


def make_tools_assets(
    out_dir: str | Path = DEFAULT_DIR,
    seed: int = 1234,
    sizes: dict[str, int] | None = None,
    model: dict[str, int] | None = None,
) -> Path:
    """Write data/{sft,sft_eval,prompts,eval_prompts}.jsonl and tiny-model/ under out_dir; returns it.

    `sizes` counts demonstrations (sft, sft_eval) and prompts; `model`: make_tiny_model's hidden and
    layers. Deterministic for its arguments; skipped when out_dir/ASSETS_OK records the same."""
    out = Path(out_dir)
    n = {"sft": 3000, "sft_eval": 256, "prompts": 2048, "eval_prompts": 256} | (sizes or {})
    shape = {"hidden": 128, "layers": 2} | (model or {})
    stamp = json.dumps({"seed": seed, "sizes": n, "model": shape, "version": ASSETS_VERSION})
    marker = out / "ASSETS_OK"
    if marker.exists() and marker.read_text() == stamp:
        return out
    rng = random.Random(seed)
    held_out = draw_problems(rng, n["eval_prompts"] + n["sft_eval"], set())
    train = draw_problems(rng, n["sft"] + n["prompts"], set(held_out))
    data = out / "data"
    sft = [sft_row(demonstration(p, rng)) for p in train[: n["sft"]]]
    sft_eval = [sft_row(demonstration(p, rng)) for p in held_out[n["eval_prompts"]:]]
    write_jsonl(data / "sft.jsonl", sft)
    write_jsonl(data / "sft_eval.jsonl", sft_eval)
    write_jsonl(data / "prompts.jsonl", [prompt_row(p) for p in train[n["sft"]:]])
    write_jsonl(data / "eval_prompts.jsonl", [prompt_row(p) for p in held_out[: n["eval_prompts"]]])
    tokenizer = make_tokenizer(rng)
    make_tiny_model(tokenizer, seed=seed, **shape).save_pretrained(out / "tiny-model")
    tokenizer.save_pretrained(out / "tiny-model")
    marker.write_text(stamp)
    return out
