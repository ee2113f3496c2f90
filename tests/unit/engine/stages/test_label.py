"""The online-label stage on the tiny demo model: answer pairs (a function of seed and round),
chosen and rejected as the labeller said, ties and empty answers dropped, a held-out share."""

import json

import pytest

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import inputs, make_ctx, model, run
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.inputs import ModelLoading
from rlflow.engine.stages.label import PAIRS_EVAL_FILE, PAIRS_FILE, LabelUpstream, PromptData, sample_answer_pairs

LONGER = {"fn": "helpers.reward_fns:prefer_longer"}


def config(small_assets, tmp_path, **label):
    tree = small_config_tree(small_assets, tmp_path, sampling={"max_new_tokens": 6})
    return build_config(tree | {"label": {"labeller": LONGER} | label}, "t")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_answer_pairs_are_a_function_of_seed_and_round(small_assets, tmp_path):
    cfg, policy = config(small_assets, tmp_path), str(small_assets / "tiny-model")
    loading, data = ModelLoading.for_stage(cfg.model, "label"), PromptData.of(cfg.data)
    pairs = sample_answer_pairs(policy, loading, data, cfg.sampling, 6, seed=3, round_index=0)
    assert len(pairs) == 6
    assert pairs == sample_answer_pairs(policy, loading, data, cfg.sampling, 6, seed=3, round_index=0)
    other = sample_answer_pairs(policy, loading, data, cfg.sampling, 6, seed=3, round_index=1)
    assert [p[0].prompt for p in other] != [p[0].prompt for p in pairs]
    assert any(a != b for _, a, b in pairs)  # two draws, not one answer twice


def test_labelled_pairs_follow_the_labeller_and_count_what_was_dropped(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, prompts_per_round=24, eval_fraction=0.25)
    label_inputs = inputs(cfg, "label", LabelUpstream(policy=model(small_assets / "tiny-model")))
    ctx = make_ctx(tmp_path, "label", sink=RecordingSink())
    outcome = run(ctx, label_inputs)
    train = read_jsonl(f"{outcome.checkpoint_uri}/{PAIRS_FILE}")
    held = read_jsonl(f"{outcome.checkpoint_uri}/{PAIRS_EVAL_FILE}")
    m = outcome.metrics
    assert (m["label/pairs"], m["label/pairs_eval"]) == (len(train), len(held))
    assert len(train) + len(held) + m["label/ties_dropped"] + m["label/empty_dropped"] == 24
    assert len(held) == round(0.25 * (len(train) + len(held)))
    assert all(len(r["chosen"]) > len(r["rejected"]) and r["rejected"].strip() for r in train + held)
    assert ctx.sink.metrics == [(0, m)]
    again = run(make_ctx(tmp_path, "label"), label_inputs)  # the stage's final marker: not run twice
    assert again.skipped and again.metrics == m


def test_without_a_held_out_share_no_eval_file_is_written(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, prompts_per_round=8)
    upstream = LabelUpstream(policy=model(small_assets / "tiny-model"))
    outcome = run(make_ctx(tmp_path, "label"), inputs(cfg, "label", upstream))
    assert "label/pairs_eval" not in outcome.metrics
    with pytest.raises(FileNotFoundError):
        read_jsonl(f"{outcome.checkpoint_uri}/{PAIRS_EVAL_FILE}")
