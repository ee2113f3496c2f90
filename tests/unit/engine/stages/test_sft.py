"""The SFT stage on the small demo assets: the loss falls, every weight moves, checkpoints commit
(locally and on S3), a finished stage is not run twice, and a stage resumes from its latest commit.
The reward-model stage: test_reward_model.py."""

import shutil

import pytest
import torch

from conftest import RecordingSink, sft_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import CheckpointError
from rlflow.engine.models.loading import load_policy


def test_sft_loss_falls_and_every_parameter_changes(small_assets, tmp_path):
    cfg = build_config(
        small_config_tree(
            small_assets, tmp_path, sft={"max_steps": 30, "eval_every": 10, "log_every": 1, "patience": 10}
        ),
        "t",
    )
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "sft", sink=sink)
    outcome = run(ctx, sft_inputs(cfg))
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
    again = run(make_ctx(tmp_path, "sft"), sft_inputs(cfg))
    assert again.skipped and again.manifest_sha256 == outcome.manifest_sha256
    with pytest.raises(CheckpointError, match="already finished with a different configuration .*x"):
        run(make_ctx(tmp_path, "sft", identity="id-2"), sft_inputs(cfg))


def test_sft_resumes_from_latest_commit(small_assets, tmp_path):
    cfg = build_config(
        small_config_tree(
            small_assets, tmp_path, sft={"max_steps": 12, "eval_every": 4, "log_every": 1, "patience": 10}
        ),
        "t",
    )
    ref = run(make_ctx(tmp_path / "a", "sft", every=4), sft_inputs(cfg))
    run(make_ctx(tmp_path / "b", "sft", every=4), sft_inputs(cfg))
    # As if killed right after committing step 8: the later step and the final marker are gone.
    shutil.rmtree(tmp_path / "b" / "sft" / "step_000012")
    (tmp_path / "b" / "sft" / "final.json").unlink()
    sink = RecordingSink()
    resumed = run(make_ctx(tmp_path / "b", "sft", every=4, sink=sink), sft_inputs(cfg))
    assert resumed.resumed_from == 8 and [s for s, _ in sink.series("sft/loss")] == [9, 10, 11, 12]
    a = load_policy(f"{ref.checkpoint_uri}/model").state_dict()
    b = load_policy(f"{resumed.checkpoint_uri}/model").state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def test_sft_checkpoints_through_s3_and_resumes_from_there(small_assets, s3_bucket, tmp_path):
    url, options = s3_bucket
    cfg = build_config(
        small_config_tree(small_assets, tmp_path, sft={"max_steps": 4, "eval_every": 2, "patience": 10}), "t"
    )

    def ctx():
        return make_ctx(url, "sft", "s3", 2, store=CheckpointStore(f"{url}/run/round_0/sft", options))

    first = ctx()
    outcome = run(first, sft_inputs(cfg))
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
    resumed = run(ctx(), sft_inputs(cfg))
    assert resumed.resumed_from == 2 and resumed.step == 4


def test_a_conversation_row_learns_every_assistant_turn_or_its_last_and_needs_a_template_for_all():
    from helpers.chat_model import CORPUS
    from rlflow.engine.config.stages import SFTConfig
    from rlflow.engine.data.records import SFTExample
    from rlflow.engine.errors import DataError
    from rlflow.engine.stages.sft import encode_sft_example
    from rlflow.engine.tasksets.demo import make_chat_tokenizer

    tokenizer = make_chat_tokenizer(CORPUS)
    turns = ({"role": "user", "content": "what is 12 plus 30"}, {"role": "assistant", "content": "result 17"},
             {"role": "user", "content": "and"})
    conversation = SFTExample(turns, "the answer is 42", whole_conversation=True)
    learned = lambda row: tokenizer.decode([i for i, m in zip(row.response, row.response_mask()) if m])  # noqa: E731
    every = encode_sft_example(tokenizer, conversation, SFTConfig(), {})
    assert learned(every) == "result 17<|im_end|>the answer is 42<|im_end|>"
    last = encode_sft_example(tokenizer, conversation, SFTConfig(assistant_turns="last"), {})
    assert learned(last) == "the answer is 42<|im_end|>"
    assert last.prompt + last.response == every.prompt + every.response
    # A prompt + response row's earlier turns are context whatever the setting.
    explicit = SFTExample(turns, "the answer is 42")
    assert encode_sft_example(tokenizer, explicit, SFTConfig(), {}) == last
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="holds 2 assistant turns .*chat_template: auto.*assistant_turns: last"):
        encode_sft_example(tokenizer, conversation, SFTConfig(), {})
    without = encode_sft_example(tokenizer, conversation, SFTConfig(assistant_turns="last"), {})
    assert learned(without) == "the answer is 42<|im_end|>" and without.prompt != last.prompt  # joined text
