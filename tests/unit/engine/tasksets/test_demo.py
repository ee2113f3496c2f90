"""The demo task's gold rule and simulated rater, by hand."""

import random

import pytest

from rlflow.engine.tasksets.demo import gold_score, in_vocabulary, make_demo_assets, noisy_gold_labeller


def test_gold_rule_by_hand():
    prompt = "describe the river ."
    # 8 words, 3 from the lexicon (calm, quiet, bright), on topic, short enough: 3/8.
    assert gold_score(prompt, "the river is calm and quiet and bright")["score"] == pytest.approx(3 / 8)
    # Off topic: halved.
    assert gold_score(prompt, "the city is calm and quiet and bright")["score"] == pytest.approx(3 / 16)
    # A word outside the vocabulary (a BPE fragment) makes the answer junk: 0.
    junk = gold_score(prompt, "the river is calm and qui et bright")
    assert junk["score"] == 0.0 and junk["valid"] == 0.0
    # The declared format rule says the same, without the gold: junk and empty answers are invalid.
    assert in_vocabulary(prompt, "the river is calm and qui et bright") == 0.0 and in_vocabulary(prompt, "") == 0.0
    assert in_vocabulary(prompt, "the city is calm and quiet and bright") == 1.0  # off topic, still valid
    # 18 words: 4 over the limit of 14 -> length factor 1 - 4/8.
    long = "the river " + " ".join(["calm"] * 16)
    parts = gold_score(prompt, long)
    assert parts["length_factor"] == pytest.approx(0.5)
    assert parts["score"] == pytest.approx(16 / 18 * 0.5)
    # Very short answers are scaled down: 2 words -> 2/4.
    assert gold_score(prompt, "river calm")["score"] == pytest.approx(0.5 * 0.5)
    assert gold_score(prompt, "")["score"] == 0.0


def test_labeller_prefers_gold_with_the_configured_noise_and_drops_ties():
    rng = random.Random(0)
    prompt, good, bad = "describe the river .", "the river is calm and bright", "the river is old and long"
    picks = [noisy_gold_labeller(prompt, good, bad, rng=rng, noise=0.1) for _ in range(4000)]
    assert 0.08 < picks.count(1) / len(picks) < 0.12  # flipped ~10% of the time
    assert noisy_gold_labeller(prompt, good, good, rng=rng, noise=0.1) is None
    assert noisy_gold_labeller(prompt, bad, good, rng=rng, noise=0.0) == 1


def test_assets_are_deterministic(tmp_path):
    sizes = {"sft": 20, "sft_eval": 4, "prefs": 10, "prefs_eval": 4, "prompts": 8, "eval_prompts": 4}
    a = make_demo_assets(tmp_path / "a", seed=3, sizes=sizes)
    b = make_demo_assets(tmp_path / "b", seed=3, sizes=sizes)
    for name in ("sft.jsonl", "preferences.jsonl", "preferences_eval.jsonl", "prompts.jsonl"):
        assert (a / "data" / name).read_bytes() == (b / "data" / name).read_bytes()
    assert (a / "tiny-model" / "model.safetensors").read_bytes() == (
        b / "tiny-model" / "model.safetensors"
    ).read_bytes()
