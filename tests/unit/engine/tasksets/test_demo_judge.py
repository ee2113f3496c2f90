"""The demo's independent judge: features by hand, the fit against a known preference, the reward function."""

import json
import math
import random

import pytest

from rlflow.engine.tasksets.demo import make_demo_assets, second_rater_pairs
from rlflow.engine.tasksets.demo_judge import (
    JUDGE_FILE,
    LENGTH_FEATURE,
    fit_second_rater,
    judge_features,
    pair_accuracy,
    score_with,
    second_rater,
)


def test_features_are_word_shares_and_length():
    assert judge_features("the calm the .") == {"the": 0.5, "calm": 0.25, ".": 0.25, LENGTH_FEATURE: 0.4}
    assert judge_features("") == {LENGTH_FEATURE: 0.0}
    # score = sum of weight x feature: 2 x 0.25 (calm) - 1 x 0.5 (the) + 0.5 x 0.4 (length) = 0.2
    assert score_with({"calm": 2.0, "the": -1.0, LENGTH_FEATURE: 0.5}, "the calm the .") == pytest.approx(0.2)


def test_fit_learns_a_planted_preference():
    # Raters prefer "warm" to "cold" in 90% of pairs, with filler words that carry no preference.
    rng = random.Random(0)
    fill = ["a", "b", "c", "d"]
    pairs = []
    for _ in range(400):
        base = [rng.choice(fill) for _ in range(4)]
        good, bad = " ".join(base + ["warm"]), " ".join(base + ["cold"])
        pairs.append({"chosen": good, "rejected": bad} if rng.random() < 0.9 else {"chosen": bad, "rejected": good})
    w = fit_second_rater(pairs, l2=1e-8)
    # Only the difference of the two words' weights is identified (filler shares cancel in every pair),
    # and each word is 1/5 of its answer: with (almost) no penalty the fit is the maximum-likelihood
    # log-odds of the pairs' own share of "warm" wins.
    share = sum("warm" in p["chosen"] for p in pairs) / len(pairs)
    assert 0.85 < share < 0.95
    assert (w["warm"] - w["cold"]) / 5 == pytest.approx(math.log(share / (1 - share)), rel=0.02)
    assert fit_second_rater(pairs, l2=1e-2)["warm"] < w["warm"]  # the penalty shrinks it
    assert pair_accuracy(w, [{"chosen": "a warm", "rejected": "a cold"}]) == 1.0
    assert pair_accuracy(w, [{"chosen": "a", "rejected": "a"}]) == 0.5  # a tie counts half


def test_the_demo_judge_agrees_with_held_out_clean_labels(tmp_path):
    sizes = {"sft": 40, "sft_eval": 4, "prefs": 10, "prefs_eval": 300, "prompts": 8, "eval_prompts": 4}
    out = make_demo_assets(tmp_path, seed=5, sizes=sizes | {"judge_pairs": 1500})
    record = json.loads((out / JUDGE_FILE).read_text())
    assert record["pairs"] == 1500 and record["rater_noise"] == 0.2
    held_out = [json.loads(line) for line in (out / "data" / "preferences_eval.jsonl").read_text().splitlines()]
    assert record["held_out_accuracy"] == pytest.approx(pair_accuracy(record["weights"], held_out))
    assert record["held_out_accuracy"] > 0.8  # a useful second opinion, from noisier labels of its own
    path = str(out / JUDGE_FILE)
    pleasant, plain = "the river is calm and bright and gentle .", "the river is old and long and wide ."
    assert second_rater("describe the river .", pleasant, weights=path) > second_rater("x", plain, weights=path)
    # A stray fragment is a word its raters never saw: weight 0, less than the pleasant word it replaces.
    assert "qu" not in record["weights"]
    assert second_rater("x", "the river is calm qu gentle .", weights=path) < second_rater(
        "x", "the river is calm bright gentle .", weights=path
    )
    # Its pairs are another pool's: not the reward model's preferences.jsonl.
    rm_pairs = [json.loads(x) for x in (out / "data" / "preferences.jsonl").read_text().splitlines()]
    assert not {p["chosen"] for p in second_rater_pairs(5, 50, noise=0.2)} & {p["chosen"] for p in rm_pairs}


def test_missing_weights_say_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="rlflow demo-assets"):
        second_rater("x", "the river .", weights=str(tmp_path / "none.json"))
