"""SFT and reward-model stages on the small demo assets: losses fall, every weight moves,
checkpoints commit, and a finished stage is not run twice."""

import shutil

import pytest
import torch

from conftest import RecordingSink, small_config_tree
from rlflow.engine.batching import encode_pair
from rlflow.engine.checkpoint import CheckpointStore
from rlflow.engine.config import build_config
from rlflow.engine.data import load_preference_pairs
from rlflow.engine.demo_task import gold_score, noisy_gold_labeller
from rlflow.engine.errors import CheckpointError
from rlflow.engine.models import load_policy, load_scalar_model, load_tokenizer, sequence_scores
from rlflow.engine.reward_model import bradley_terry_loss, run_reward_model_stage
from rlflow.engine.rollout import SamplingParams
from rlflow.engine.round_stages import PAIRS_EVAL_FILE, PAIRS_FILE, run_label_stage
from rlflow.engine.sft import run_sft_stage
from rlflow.engine.stage import StageContext


def make_ctx(root, stage, identity="id-1", every=10, sink=None):
    return StageContext(
        store=CheckpointStore(f"{root}/{stage}"),
        stage=stage,
        round_index=0,
        seed=0,
        identity=identity,
        identity_tree={"x": identity},
        every_steps=every,
        sink=sink or RecordingSink(),
    )


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)): d = 2, 0, -2
    expected = torch.log1p(torch.exp(-torch.tensor([2.0, 0.0, -2.0])))
    assert torch.allclose(bradley_terry_loss(chosen, rejected), expected)
    assert bradley_terry_loss(chosen, rejected)[1].item() == pytest.approx(0.693147, abs=1e-6)


def test_sft_loss_falls_and_every_parameter_changes(small_assets, tmp_path):
    cfg = build_config(
        small_config_tree(
            small_assets, tmp_path, sft={"max_steps": 30, "eval_every": 10, "log_every": 1, "patience": 10}
        ),
        "t",
    )
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "sft", sink=sink)
    outcome = run_sft_stage(ctx, cfg.model.path, cfg.model, cfg.sft, cfg.data)
    losses = [v for _, v in sink.series("sft/loss")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    evals = [v for _, v in sink.series("sft/eval_loss")]
    assert evals[-1] < evals[0]
    before = load_policy(cfg.model.path).state_dict()
    after = load_policy(f"{outcome.checkpoint_uri}/model").state_dict()
    unchanged = [
        k
        for k in before
        if torch.equal(before[k], after[k]) and before[k].dtype.is_floating_point and "rotary" not in k
    ]
    assert unchanged == []
    assert ctx.store.final()["step"] == 30 and outcome.step == 30
    assert ctx.store.committed_steps() == [20, 30]  # keep_last=2 pruned step 10
    # Run again: the final marker says it is done, so nothing is trained.
    again = run_sft_stage(make_ctx(tmp_path, "sft"), cfg.model.path, cfg.model, cfg.sft, cfg.data)
    assert again.skipped and again.manifest_sha256 == outcome.manifest_sha256
    with pytest.raises(CheckpointError, match="already finished with a different configuration .*x"):
        run_sft_stage(make_ctx(tmp_path, "sft", identity="id-2"), cfg.model.path, cfg.model, cfg.sft, cfg.data)


def test_sft_resumes_from_latest_commit(small_assets, tmp_path):
    cfg = build_config(
        small_config_tree(
            small_assets, tmp_path, sft={"max_steps": 12, "eval_every": 4, "log_every": 1, "patience": 10}
        ),
        "t",
    )
    ref = run_sft_stage(make_ctx(tmp_path / "a", "sft", every=4), cfg.model.path, cfg.model, cfg.sft, cfg.data)
    run_sft_stage(make_ctx(tmp_path / "b", "sft", every=4), cfg.model.path, cfg.model, cfg.sft, cfg.data)
    # As if killed right after committing step 8: the later step and the final marker are gone.
    shutil.rmtree(tmp_path / "b" / "sft" / "step_000012")
    (tmp_path / "b" / "sft" / "final.json").unlink()
    sink = RecordingSink()
    resumed = run_sft_stage(
        make_ctx(tmp_path / "b", "sft", every=4, sink=sink), cfg.model.path, cfg.model, cfg.sft, cfg.data
    )
    assert resumed.resumed_from == 8 and [s for s, _ in sink.series("sft/loss")] == [9, 10, 11, 12]
    a = load_policy(f"{ref.checkpoint_uri}/model").state_dict()
    b = load_policy(f"{resumed.checkpoint_uri}/model").state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_reward_model_learns_preferences(trained, small_assets, tmp_path):
    sft_dir, rm_dir, (mean, std) = trained
    cfg = build_config(small_config_tree(small_assets, tmp_path, rm={"epochs": 3, "log_every": 1}), "t")
    sink = RecordingSink()
    outcome = run_reward_model_stage(make_ctx(tmp_path, "rm", sink=sink), sft_dir, cfg.model, cfg.rm, cfg.data)
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
    cfg = build_config(tree, "t")
    sampling = SamplingParams(1.0, 1.0, 12)

    def label(root, fraction):
        ctx = make_ctx(root, "label")
        labeller, kwargs = noisy_gold_labeller, {"noise": 0.0}
        outcome = run_label_stage(ctx, sft_dir, cfg.model, cfg.data, sampling, labeller, kwargs, 96, fraction)
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

    outcome = run_reward_model_stage(
        make_ctx(tmp_path, "rm"), sft_dir, cfg.model, cfg.rm, cfg.data, (train_url,), (eval_url,)
    )
    assert "rm/accuracy" not in outcome.metrics and outcome.metrics["rm/pairs"] == len(train)
    # Recomputed from the saved reward model: the share of held-out pairs it orders as labelled.
    model = load_scalar_model(f"{outcome.checkpoint_uri}/model").eval()
    tokenizer = load_tokenizer(sft_dir, chat_template="none")
    scores = lambda prompt, answer: float(sequence_scores(model, *encoded(tokenizer, prompt, answer)))  # noqa: E731
    with torch.no_grad():
        right = sum(scores(p.prompt, p.chosen) > scores(p.prompt, p.rejected) for p in held)
    assert outcome.metrics["rm/accuracy_online"] == pytest.approx(right / len(held))


def encoded(tokenizer, prompt, answer):
    row = encode_pair(tokenizer, prompt, answer, 128)  # one row, unpadded: no batching involved
    ids = torch.tensor([row.prompt + row.response])
    return ids, torch.ones_like(ids)


def test_sft_checkpoints_through_s3_and_resumes_from_there(small_assets, s3_bucket, tmp_path):
    url, options = s3_bucket
    cfg = build_config(
        small_config_tree(small_assets, tmp_path, sft={"max_steps": 4, "eval_every": 2, "patience": 10}), "t"
    )

    def ctx():
        return StageContext(
            store=CheckpointStore(f"{url}/run/round_0/sft", options),
            stage="sft",
            round_index=0,
            seed=0,
            identity="s3",
            identity_tree={},
            every_steps=2,
        )

    first = ctx()
    outcome = run_sft_stage(first, cfg.model.path, cfg.model, cfg.sft, cfg.data)
    assert outcome.checkpoint_uri == f"{url}/run/round_0/sft/step_000004"
    assert first.store.committed_steps() == [2, 4]
    first.store.verify(4)
    # The weights come back from S3 as an ordinary HF directory.
    local = first.store.local_dir(4, cache_dir=str(tmp_path / "cache"))
    assert load_policy(f"{local}/model").config.model_type == "llama"
    # Killed after step 2 (later step and final marker gone): the stage continues from S3.
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.rm(f"{url}/run/round_0/sft/final.json")
    fs.rm(f"{url}/run/round_0/sft/step_000004", recursive=True)
    resumed = run_sft_stage(ctx(), cfg.model.path, cfg.model, cfg.sft, cfg.data)
    assert resumed.resumed_from == 2 and resumed.step == 4
