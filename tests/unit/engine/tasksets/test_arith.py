"""The arithmetic demo task: its gold rule by hand, its assets (deterministic, correct where
clean, noisy at the configured rate where not, held-out problems held out) and its tokenizer."""

import json
import math
import random

import pytest

from rlflow.engine.rewards.rules import exact_match_rule
from rlflow.engine.tasksets.arith import (
    SFT_NOISE,
    SLIPS,
    gold_score,
    make_arith_assets,
    make_tokenizer,
    noisy_gold_labeller,
    solve,
)

FILES = ("sft", "sft_eval", "preferences", "preferences_eval", "prompts", "eval_prompts")
SIZES = {"sft": 4000, "sft_eval": 200, "prefs": 300, "prefs_eval": 100, "prompts": 300, "eval_prompts": 200}
TINY = {"hidden": 16, "layers": 1}  # the model's size does not matter here; building it should be quick


def rows(assets, name):
    return [json.loads(line) for line in (assets / "data" / f"{name}.jsonl").read_text().splitlines()]


def problem(prompt):
    return prompt.split()[2], prompt.split()[4]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_arith_assets(tmp_path_factory.mktemp("arith"), seed=5, sizes=SIZES, model=TINY)


def test_gold_rule_by_hand():
    prompt = "what is 23 + 48 ?"
    assert gold_score(prompt, "71", answer="71") == {"score": 1.0, "valid": 1.0, "slip": 0.0}
    # Read as the exact_match reward reads answers: spaces, one trailing '.', numbers as numbers.
    for right in ("  71 ", "71.", "071", "71.0"):
        assert gold_score(prompt, right, answer="71") == {"score": 1.0, "valid": 1.0, "slip": 0.0}, right
    assert gold_score(prompt, "72", answer="71") == {"score": 0.0, "valid": 1.0, "slip": 1.0}
    assert gold_score(prompt, "81", answer="71")["slip"] == 1.0  # tens digit off by one
    assert gold_score(prompt, "15", answer="71") == {"score": 0.0, "valid": 1.0, "slip": 0.0}
    for junk in ("7 1", "seventy", "", "71 ?", "71..", "is 71"):
        assert gold_score(prompt, junk, answer="71") == {"score": 0.0, "valid": 0.0, "slip": 0.0}, junk
    assert gold_score(prompt, "71", answer=71)["score"] == 1.0  # a numeric answer column works too
    assert gold_score(prompt, "71")["score"] == 0.0  # no answer: nothing is right


def test_gold_rule_agrees_with_the_exact_match_reward():
    """Eval accuracy must measure what RL on {type: exact_match, kwargs: {field: answer}} optimises."""
    rule = exact_match_rule(field="answer")
    responses = ["71", " 71", "71 ", "71.", "071", "71.0", "+71", "70", "7 1", "", ".", "seventy", "71 ?", "1,071"]
    for answer in ("71", "100", "1071"):
        for response in responses + [answer, answer + "."]:
            expected = rule("what is 23 + 48 ?", response, {"answer": answer})
            assert gold_score("what is 23 + 48 ?", response, answer=answer)["score"] == expected, (response, answer)


def test_labeller_prefers_the_right_sum_with_the_configured_noise():
    rng = random.Random(0)
    prompt = "what is 23 + 48 ?"
    picks = [noisy_gold_labeller(prompt, "71", "72", rng=rng, noise=0.1) for _ in range(4000)]
    assert 0.08 < picks.count(1) / len(picks) < 0.12
    assert noisy_gold_labeller(prompt, "70", "72", rng=rng, noise=0.0) is None  # both wrong: a tie
    assert noisy_gold_labeller(prompt, "72", "71", rng=rng, noise=0.0, answer="71") == 1


def test_assets_are_deterministic(tmp_path):
    sizes = {"sft": 20, "sft_eval": 4, "prefs": 10, "prefs_eval": 4, "prompts": 8, "eval_prompts": 4}
    a = make_arith_assets(tmp_path / "a", seed=3, sizes=sizes, model=TINY)
    b = make_arith_assets(tmp_path / "b", seed=3, sizes=sizes, model=TINY)
    c = make_arith_assets(tmp_path / "c", seed=4, sizes=sizes, model=TINY)
    for name in FILES:
        assert (a / "data" / f"{name}.jsonl").read_bytes() == (b / "data" / f"{name}.jsonl").read_bytes()
    assert (a / "data" / "sft.jsonl").read_bytes() != (c / "data" / "sft.jsonl").read_bytes()
    weights = "tiny-model/model.safetensors"
    assert (a / weights).read_bytes() == (b / weights).read_bytes()
    assert (a / "ASSETS_OK").read_text() == (b / "ASSETS_OK").read_text()


def test_clean_files_are_right_and_prompts_carry_the_answer(assets):
    for name in ("prompts", "eval_prompts"):
        data = rows(assets, name)
        assert len(data) == SIZES[name] and all(set(r) == {"prompt", "answer"} for r in data)
        assert all(r["answer"] == str(sum(map(int, problem(r["prompt"])))) == solve(r["prompt"]) for r in data)
    for name in ("preferences", "preferences_eval"):
        for r in rows(assets, name):
            assert r["chosen"] == solve(r["prompt"]) and int(r["rejected"]) - int(r["chosen"]) in SLIPS


def test_sft_noise_rate_and_slips(assets):
    data = rows(assets, "sft")
    wrong = [r for r in data if r["response"] != solve(r["prompt"])]
    rate, sigma = len(wrong) / len(data), math.sqrt(SFT_NOISE * (1 - SFT_NOISE) / len(data))
    assert abs(rate - SFT_NOISE) < 4 * sigma, (rate, SFT_NOISE)
    assert all(int(r["response"]) - int(solve(r["prompt"])) in SLIPS for r in wrong)  # plausible slips only
    assert all(int(r["response"]) >= 0 for r in data)


def test_held_out_problems_never_appear_in_training_files(assets):
    held_out = {
        problem(r["prompt"]) for name in ("sft_eval", "preferences_eval", "eval_prompts") for r in rows(assets, name)
    }
    seen = {problem(r["prompt"]) for name in ("sft", "preferences", "prompts") for r in rows(assets, name)}
    assert held_out and not held_out & seen


def test_tokenizer_round_trips_numbers_digit_by_digit(assets):
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(assets / "tiny-model")
    for tok in (make_tokenizer(), saved):
        for n in list(range(0, 200)) + [1234567890]:
            ids = tok(str(n), add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == str(n)
            assert tok.convert_ids_to_tokens(ids) == ["▁", *str(n)]  # one token per digit
        prompt = "what is 23 + 48 ?"
        assert tok.decode(tok(prompt, add_special_tokens=False)["input_ids"]) == prompt
        assert tok.unk_token_id not in tok(prompt + " 71", add_special_tokens=False)["input_ids"]


def test_demo_assets_command_builds_the_arith_task(tmp_path, capsys):
    from rlflow.flows.cli.main import build_parser, main

    assert main(["demo-assets", "--task", "arith", str(tmp_path / "arith"), "--seed", "3"]) == 0
    out = tmp_path / "arith"
    assert capsys.readouterr().out.strip() == str(out)
    assert all((out / "data" / f"{name}.jsonl").is_file() for name in FILES)
    assert (out / "tiny-model" / "tokenizer.json").is_file() and (out / "ASSETS_OK").is_file()
    plain = build_parser().parse_args(["demo-assets"])  # the main demo's command is unchanged
    assert (plain.task, plain.dir) == ("demo", None)
