"""A verifiable-reward demo task: add two numbers, e.g. "what is 23 + 48 ?" -> "71".

The answer can be checked exactly (gold_score compares it with the prompt row's `answer`
column), so RL can train on the rule itself (GRPO with an exact_match reward) instead of a learned
reward model. The SFT demonstrations come from an imperfect annotator: a fixed share of them
(SFT_NOISE) carry a plausible slip (off by one, or a tens digit off by one, as a dropped or extra
carry gives). A policy trained on them learns the annotator's answer distribution: its most
likely answer is usually right, but sampled at temperature 1 it reproduces the slips. That
gap between greedy and sampled accuracy is the headroom an exact-match reward can recover.

Held-out means held out: the eval prompts (and data.sft_eval) are problems that never appear
in the SFT, preference or RL prompt files, so eval accuracy measures addition, not recall.

Run `python -m rlflow.engine.tasksets.arith OUT_DIR` to write the assets (deterministic, a few seconds).
"""

from __future__ import annotations

import json
import random
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

from rlflow.engine.tasksets.demo import make_tiny_model, write_jsonl

# Two-digit operands only: every prompt has the same shape, so each digit sits at a fixed position
# (mixing in one-digit operands shifts them, and a tiny model then learns addition more slowly).
OPERANDS = (10, 99)  # 8,100 problems, sums 20..198
PROMPT_TEMPLATE = "what is {a} + {b} ?"
SFT_NOISE = 0.4  # share of SFT demonstrations with a wrong answer
SLIPS = (-10, -1, 1, 10)  # the annotator's mistakes: a units or tens digit off by one
EVAL_SHARE = 0.1  # share of all problems reserved for held-out evaluation
# A number as the exact_match reward rule reads one: signed, decimal, thousands separators.
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
PROMPT = re.compile(r"what is (\d+) \+ (\d+) \?")
DEFAULT_DIR = "demo_assets/arith"
ASSETS_VERSION = 1


def gold_score(prompt: str, response: str, **fields: Any) -> dict[str, float]:
    """1.0 when the response is the `answer` field, read as the reward's exact_match rule reads it.

    So that eval accuracy measures exactly what RL on `{type: exact_match, kwargs: {field: answer}}`
    optimises, both sides are normalised the same way as that rule's default (normalize: true):
    spaces collapsed, one trailing '.' dropped, and numbers compared as numbers. Hence " 71 ",
    "71." and "071" are right; "7 1" and "seventy one" are not. Components (logged as
    eval/gold/<name>): valid (the normalised response is a well-formed number) and slip (a
    wrong but well-formed answer of the annotator's kind, one of SLIPS away).
    """
    text, answer = _normalized(response), _normalized(str(fields.get("answer", "")))
    valid = NUMBER.fullmatch(text) is not None
    if valid and NUMBER.fullmatch(answer):
        difference = Decimal(text.replace(",", "")) - Decimal(answer.replace(",", ""))
        correct, slip = difference == 0, difference in SLIPS
    else:
        correct, slip = text == answer != "", False
    return {"score": float(correct), "valid": float(valid), "slip": float(slip)}


def _normalized(text: str) -> str:
    """As reward_rules' exact_match normalises: lowercase, spaces collapsed, one trailing '.' off."""
    text = " ".join(text.strip().lower().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def noisy_gold_labeller(
    prompt: str, answer_a: str, answer_b: str, *, rng: random.Random, noise: float = 0.1, **fields: Any
) -> int | None:
    """Simulated rater: 0 if answer_a is preferred, 1 if answer_b, None for a tie (dropped).

    The gold preference (right over wrong), flipped with probability `noise`. Without an
    `answer` field it is computed from the prompt, so preference rows need no extra column.
    """
    answer = fields.get("answer", solve(prompt))
    a = gold_score(prompt, answer_a, answer=answer)["score"]
    b = gold_score(prompt, answer_b, answer=answer)["score"]
    if a == b:
        return None
    preferred = 0 if a > b else 1
    return 1 - preferred if rng.random() < noise else preferred


def solve(prompt: str) -> str:
    """The correct answer of a task prompt, as text ("" for a prompt of another shape)."""
    match = PROMPT.fullmatch(prompt.strip())
    return str(int(match[1]) + int(match[2])) if match else ""


def slip(answer: int, rng: random.Random) -> int:
    """A plausible wrong answer: one of SLIPS applied to `answer`, never negative."""
    return answer + rng.choice([d for d in SLIPS if answer + d >= 0])


def split_problems(
    rng: random.Random, operands: tuple[int, int] = OPERANDS
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All (a, b) problems with operands in the closed range, shuffled and cut into (train, held out)."""
    low, high = operands
    problems = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    rng.shuffle(problems)
    cut = int(len(problems) * EVAL_SHARE)
    return problems[cut:], problems[:cut]


def make_sft_rows(rng: random.Random, problems: list[tuple[int, int]], n: int, noise: float) -> list[dict[str, str]]:
    """Demonstrations: the right sum, or with probability `noise` a slip of it."""
    rows = []
    for _ in range(n):
        a, b = rng.choice(problems)
        answer = a + b if rng.random() >= noise else slip(a + b, rng)
        rows.append({"prompt": PROMPT_TEMPLATE.format(a=a, b=b), "response": str(answer)})
    return rows


def make_preference_rows(rng: random.Random, problems: list[tuple[int, int]], n: int) -> list[dict[str, str]]:
    """Pairs with chosen = the right sum and rejected = a slip of it (clean labels)."""
    rows = []
    for _ in range(n):
        a, b = rng.choice(problems)
        prompt = PROMPT_TEMPLATE.format(a=a, b=b)
        rows.append({"prompt": prompt, "chosen": str(a + b), "rejected": str(slip(a + b, rng))})
    return rows


def make_prompt_rows(rng: random.Random, problems: list[tuple[int, int]], n: int) -> list[dict[str, str]]:
    """RL or eval prompts, each with its `answer` column (the exact-match reward's target)."""
    rows = []
    for _ in range(n):
        a, b = rng.choice(problems)
        rows.append({"prompt": PROMPT_TEMPLATE.format(a=a, b=b), "answer": str(a + b)})
    return rows


def make_tokenizer():
    """A BPE tokenizer in which every digit is its own token (so "71" is "▁", "7", "1").

    Metaspace keeps decode(encode(x)) == x; splitting digits apart keeps the numbers' structure
    visible to the model (a merged "71" token would make each sum a lookup of its own).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=48, special_tokens=["<pad>", "<eos>", "<unk>"])
    # The corpus only has to hold every character and word of the task; its counts set the merges.
    corpus = [PROMPT_TEMPLATE.format(a=a, b=a) for a in range(0, 100, 7)] + ["0123456789 - = ."]
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_arith_assets(
    out_dir: str | Path = DEFAULT_DIR,
    seed: int = 1234,
    sizes: dict[str, int] | None = None,
    noise: float = SFT_NOISE,
    model: dict[str, int] | None = None,
    operands: tuple[int, int] = OPERANDS,
) -> Path:
    """Write data/*.jsonl and tiny-model/ (weights + tokenizer) under out_dir; returns out_dir.

    The same six files as the main demo; prompt files carry an `answer` column. `model`:
    make_tiny_model's hidden and layers. Deterministic for its arguments; skipped when
    out_dir/ASSETS_OK already records the same settings.
    """
    out = Path(out_dir)
    n = {"sft": 8000, "sft_eval": 1024, "prefs": 2000, "prefs_eval": 400, "prompts": 2048, "eval_prompts": 512}
    n.update(sizes or {})
    shape = {"hidden": 128, "layers": 2} | (model or {})
    settings = {"seed": seed, "sizes": n, "noise": noise, "model": shape, "operands": list(operands)}
    stamp = json.dumps(settings | {"version": ASSETS_VERSION})
    marker = out / "ASSETS_OK"
    if marker.exists() and marker.read_text() == stamp:
        return out
    rng = random.Random(seed)
    train, held_out = split_problems(rng, operands)
    data = out / "data"
    write_jsonl(data / "sft.jsonl", make_sft_rows(rng, train, n["sft"], noise))
    # Held-out loss on the same noisy annotator: its floor is the noise's entropy, where SFT plateaus.
    write_jsonl(data / "sft_eval.jsonl", make_sft_rows(rng, held_out, n["sft_eval"], noise))
    write_jsonl(data / "preferences.jsonl", make_preference_rows(rng, train, n["prefs"]))
    write_jsonl(data / "preferences_eval.jsonl", make_preference_rows(rng, held_out, n["prefs_eval"]))
    write_jsonl(data / "prompts.jsonl", make_prompt_rows(rng, train, n["prompts"]))
    write_jsonl(data / "eval_prompts.jsonl", make_prompt_rows(rng, held_out, n["eval_prompts"]))
    tokenizer = make_tokenizer()
    make_tiny_model(tokenizer, seed=seed, **shape).save_pretrained(out / "tiny-model")
    tokenizer.save_pretrained(out / "tiny-model")
    marker.write_text(stamp)
    return out


if __name__ == "__main__":
    print(make_arith_assets(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
