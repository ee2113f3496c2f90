"""The reward-model stage on the small demo assets: the Bradley-Terry loss by hand, the loss falls and
every weight moves, and online labels alone train a reward model measured on held-out pairs."""

import pytest
import torch
from conftest import RecordingSink, rm_inputs, small_config_tree
from helpers.stage_ctx import inputs, make_ctx, model, run

from rlflow.engine.backend.runtime import OptimSpec, Runtime
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.config.schema import build_config
from rlflow.engine.data.batching import encode_pair
from rlflow.engine.data.records import load_preference_pairs, load_sft_examples
from rlflow.engine.errors import ConfigError
from rlflow.engine.models.loading import load_scalar_model, load_tokenizer, sequence_scores
from rlflow.engine.stages.inputs import LabelsInput
from rlflow.engine.stages.label import PAIRS_EVAL_FILE, PAIRS_FILE, LabelUpstream
from rlflow.engine.stages.reward_model import (
    _pair_rows,
    accuracy_by_spread,
    bradley_terry_loss,
    rm_train_step,
    score_norm_from_metrics,
)
from rlflow.engine.tasksets.demo import gold_score


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)): d = 2, 0, -2
    expected = torch.log1p(torch.exp(-torch.tensor([2.0, 0.0, -2.0])))
    assert torch.allclose(bradley_terry_loss(chosen, rejected), expected)
    assert bradley_terry_loss(chosen, rejected)[1].item() == pytest.approx(0.693147, abs=1e-6)


def test_reward_model_learns_preferences(trained, small_assets, tmp_path):
    sft_dir, rm_dir, (mean, std) = trained
    cfg = build_config(small_config_tree(small_assets, tmp_path, rm={"epochs": 3, "log_every": 1}), "t")
    sink = RecordingSink()
    outcome = run(make_ctx(tmp_path, "rm", sink=sink), rm_inputs(cfg, sft_dir))
    losses = [v for _, v in sink.series("rm/loss")]
    assert len(losses) == 39  # 3 epochs x ceil(400 pairs / 32)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.15  # starts at log 2 = 0.693 (zero-initialised head)
    assert outcome.metrics["rm/accuracy"] >= 0.7  # clean held-out labels
    assert outcome.metrics["rm/score_std"] > 0
    before = load_scalar_model(sft_dir).state_dict()
    after = load_scalar_model(f"{outcome.checkpoint_uri}/model").state_dict()
    unchanged = [
        k for k in after if k in before and torch.equal(before[k], after[k]) and after[k].dtype.is_floating_point
    ]
    assert unchanged == []


def test_online_labels_alone_train_a_reward_model_measured_on_held_out_pairs(trained, small_assets, tmp_path):
    sft_dir = trained[0]
    tree = small_config_tree(small_assets, tmp_path, data={"preferences": None, "preferences_eval": None})
    labeller = {"fn": "rlflow.engine.tasksets.demo:noisy_gold_labeller", "kwargs": {"noise": 0.0}}

    def label(root, fraction):
        settings = {"labeller": labeller, "prompts_per_round": 96, "eval_fraction": fraction}
        cfg = build_config(tree | {"label": settings}, "t")
        outcome = run(make_ctx(root, "label"), inputs(cfg, "label", LabelUpstream(policy=model(sft_dir))))
        return outcome, f"{outcome.checkpoint_uri}/{PAIRS_FILE}", f"{outcome.checkpoint_uri}/{PAIRS_EVAL_FILE}"

    split, train_url, eval_url = label(tmp_path / "split", 0.25)
    whole, whole_url, _ = label(tmp_path / "whole", 0.0)
    train, held = load_preference_pairs(train_url), load_preference_pairs(eval_url)
    assert (split.metrics["label/pairs"], split.metrics["label/pairs_eval"]) == (len(train), len(held))
    assert len(held) == round(0.25 * (len(train) + len(held))) and len(held) >= 5
    # The split takes its draws from its own stream: the same pairs as without it, just divided.
    as_tuples = lambda pairs: sorted((p.prompt, p.chosen, p.rejected) for p in pairs)  # noqa: E731
    assert as_tuples(train + held) == as_tuples(load_preference_pairs(whole_url))
    assert "label/pairs_eval" not in whole.metrics
    assert all(gold_score(p.prompt, p.chosen)["score"] > gold_score(p.prompt, p.rejected)["score"] for p in held)

    cfg = build_config(tree, "t")
    labelled = LabelsInput(identity="labels", train=train_url, held_out=eval_url)
    outcome = run(make_ctx(tmp_path, "rm"), rm_inputs(cfg, sft_dir, (labelled,)))
    assert "rm/accuracy" not in outcome.metrics and outcome.metrics["rm/pairs"] == len(train)
    # Recomputed from the saved reward model: the share of held-out pairs it orders as labelled.
    saved = load_scalar_model(f"{outcome.checkpoint_uri}/model").eval()
    tokenizer = load_tokenizer(sft_dir, chat_template="none")
    scores = lambda prompt, answer: float(sequence_scores(saved, *encoded(tokenizer, prompt, answer)))  # noqa: E731
    with torch.no_grad():
        right = sum(scores(p.prompt, p.chosen) > scores(p.prompt, p.rejected) for p in held)
    assert outcome.metrics["rm/accuracy_online"] == pytest.approx(right / len(held))


def encoded(tokenizer, prompt, answer):
    row = encode_pair(tokenizer, prompt, answer, 128)  # one row, unpadded: no batching involved
    ids = torch.tensor([row.prompt + row.response])
    return ids, torch.ones_like(ids)


def test_pair_accuracy_split_by_the_ensembles_spread_by_hand():
    margins = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0, 0.0])
    spread = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.7, 0.3, 0.5])
    # Lowest spread: pairs 0, 2, 5 (all right); highest: 1, 4, 3 (one right); the median pair 6 in neither.
    assert accuracy_by_spread(margins, spread) == (pytest.approx(1.0), pytest.approx(1 / 3))


def test_an_ensembles_heads_train_on_their_own_resamples_and_are_normalised_each(trained, small_assets, tmp_path):
    sft_dir = trained[0]
    cfg = build_config(small_config_tree(small_assets, tmp_path, rm={"epochs": 1, "ensemble": 4}), "t")
    outcome = run(make_ctx(tmp_path, "rm"), rm_inputs(cfg, sft_dir))
    metrics = outcome.metrics
    assert metrics["rm/heads"] == 4 and metrics["rm/accuracy"] >= 0.7
    assert 0.0 <= metrics["rm/accuracy_std_bottom_half"] <= 1.0 and 0.0 <= metrics["rm/accuracy_std_top_half"] <= 1.0
    model_dir = f"{outcome.checkpoint_uri}/model"
    model = load_scalar_model(model_dir).eval()
    head = model.score.weight.detach()
    assert head.shape[0] == 4 and all(not torch.allclose(head[0], head[h]) for h in (1, 2, 3))
    # Each head normalised by its own statistics: on the reference set (the first rm.norm_samples SFT
    # rows) every head's normalised scores have mean 0 and std 1.
    tokenizer = load_tokenizer(sft_dir, chat_template="none")
    mean, std = score_norm_from_metrics(metrics)
    assert len(mean) == len(std) == 4 and len(set(mean)) == 4
    reference = load_sft_examples(cfg.data.sft)[: cfg.rm.norm_samples]
    with torch.no_grad():
        raw = torch.cat([sequence_scores(model, *encoded(tokenizer, ex.prompt, ex.response)) for ex in reference])
    normalised = (raw - torch.tensor(mean)) / torch.tensor(std)
    assert torch.allclose(normalised.mean(0), torch.zeros(4), atol=1e-3)
    assert torch.allclose(normalised.std(0), torch.ones(4), atol=1e-3)
    # A critic started from it (heads=1) scores the heads' mean, exactly (the head is linear).
    averaged = load_scalar_model(model_dir, heads=1).eval()
    ids, mask = encoded(tokenizer, reference[0].prompt, reference[0].response)
    with torch.no_grad():
        assert averaged.score.out_features == 1
        assert torch.allclose(sequence_scores(averaged, ids, mask), sequence_scores(model, ids, mask).mean(1))
    with pytest.raises(ConfigError, match="holds an ensemble of 4 score heads, not 3"):
        load_scalar_model(model_dir, heads=3)


def test_a_heads_loss_counts_each_pair_as_often_as_its_resample_draws_it(trained, small_assets, tmp_path):
    sft_dir = trained[0]
    tokenizer = load_tokenizer(sft_dir, chat_template="none")
    rows = _pair_rows(tokenizer, list(load_preference_pairs(f"{small_assets}/data/preferences.jsonl")), 64)
    runtime = Runtime(EngineConfig())
    engine = runtime.trainable("model", lambda: load_scalar_model(sft_dir, heads=3), OptimSpec(1e-3, 0.0, 0, 10, 1.0))
    engine.model.config.pad_token_id = tokenizer.pad_token_id
    engine.train()
    before = engine.model.score.weight.detach().clone()
    weights = torch.ones(len(rows), 3)
    weights[:, 1] = 0.0  # head 1's resample draws no pair: its loss is 0 and its head must not move
    weights[:, 2] = 2.0
    rm_train_step(engine, runtime, rows, weights, tokenizer.pad_token_id, 16, 1, make_ctx(tmp_path, "rm"))
    after = engine.model.score.weight.detach()
    assert torch.equal(after[1], before[1])
    assert not torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])
