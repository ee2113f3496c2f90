"""Bad-input cases below the CLI (the CLI ones are in tests/unit/flows/cli/test_main_bad_inputs.py): a
disk that fills up during a checkpoint write, and tokenizers without a pad (handled) or an EOS token
(refused)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import sft_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import CheckpointError, ConfigError
from rlflow.engine.faults import FAULT_ENV
from rlflow.engine.models.loading import check_shared_vocabulary, load_tokenizer
from rlflow.engine.stages.context import StageContext


def sft_config(assets: Path, root: Path, max_steps: int):
    sft = {"max_steps": max_steps, "eval_every": 3, "log_every": 1, "batch_size": 8, "warmup_steps": 1}
    return build_config(small_config_tree(assets, root, sft=sft | {"patience": 10}), "test")


def sft_context(store_url: str, every_steps: int) -> StageContext:
    # keep_last: the step committed before the failure must survive the resumed run too
    return make_ctx(None, "sft", "id-disk", every_steps, store=CheckpointStore(store_url), keep_last=10)


def step_files(store: CheckpointStore, step: int) -> dict[str, bytes]:
    folder = Path(store.local_dir(step))
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_disk_full_during_a_checkpoint_keeps_the_last_committed_step(small_assets, tmp_path, monkeypatch):
    cfg, url = sft_config(small_assets, tmp_path, max_steps=4), f"{tmp_path}/sft"
    monkeypatch.setenv(FAULT_ENV, "sft:disk_full:4")
    with pytest.raises(CheckpointError) as info:
        run(sft_context(url, every_steps=2), sft_inputs(cfg))
    assert str(info.value) == (
        f"no space left on device while writing checkpoint {url}/step_000004 (file optim/model.rank00000.safetensors);"
        " the step was not committed and earlier steps are intact: free space (or lower checkpoint.keep_last) and"
        " rerun to resume from the last committed step"
    )
    store = CheckpointStore(url)
    assert store.committed_steps() == [2] and store.final() is None
    assert not (tmp_path / "sft" / "step_000004").exists()  # the torn step was cleaned up
    store.verify(2)  # every file still matches the sha256 its manifest committed
    committed = step_files(store, 2)

    monkeypatch.delenv(FAULT_ENV)
    outcome = run(sft_context(url, every_steps=2), sft_inputs(cfg))
    assert (outcome.resumed_from, outcome.step) == (2, 4)
    assert step_files(store, 2) == committed  # resuming read step 2 and left it as it was
    assert store.committed_steps() == [2, 4] and store.final()["step"] == 4


@pytest.fixture
def no_pad_model(small_assets, tmp_path) -> Path:
    """The demo model with a tokenizer that has an EOS but no pad token (like Llama's)."""
    path = tmp_path / "no-pad"
    shutil.copytree(small_assets / "tiny-model", path)
    tokenizer = load_tokenizer(str(path))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    return path


def test_tokenizer_without_pad_token_pads_with_another_special_token_and_trains(small_assets, no_pad_model, tmp_path):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(no_pad_model)
    assert plain.pad_token is None
    tokenizer = load_tokenizer(str(no_pad_model))
    # an existing special token that does not end a response (engine/models/tokens.py); nothing added
    assert tokenizer.pad_token_id in plain.all_special_ids and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == len(plain)
    cfg = sft_config(small_assets, tmp_path, max_steps=1)
    ctx = sft_context(f"{tmp_path}/sft", every_steps=1)
    outcome = run(ctx, sft_inputs(cfg, str(no_pad_model)))
    assert outcome.step == 1 and ctx.store.committed_steps() == [1]
    losses = [v for _, v in ctx.sink.series("sft/loss")]
    assert len(losses) == 1 and 0 < losses[0] < 100


def test_tokenizer_without_pad_or_eos_is_refused(no_pad_model):
    tokenizer = load_tokenizer(str(no_pad_model))
    tokenizer.pad_token, tokenizer.eos_token = None, None
    tokenizer.save_pretrained(no_pad_model)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(no_pad_model))
    assert str(info.value) == (
        f"model.path '{no_pad_model}': the tokenizer has no EOS token; every response ends with EOS (or the chat"
        " template's end of turn), so set eos_token in its tokenizer_config.json"
    )


def test_a_reward_model_with_the_policys_tokenizer_passes(small_assets, no_pad_model):
    # Same vocabulary, only the pad token differs: PPO's token ids mean the same to both.
    check_shared_vocabulary(str(small_assets / "tiny-model"), str(no_pad_model))
