"""Model loading and the forward passes: what PPO's correctness silently depends on."""

import json
import shutil

import pytest
import torch

from rlflow.engine.errors import ConfigError
from rlflow.engine.models.loading import (
    load_policy,
    load_scalar_model,
    load_tokenizer,
    position_ids_from_mask,
    resolve_model_path,
    scalar_head,
    sequence_scores,
)
from rlflow.engine.models.identity import model_fingerprint
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.models.tokens import response_mask_from_ids


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_response_mask_keeps_the_first_eos_and_nothing_after():
    eos = 9
    ids = torch.tensor([[5, 9, 1, 9], [5, 6, 7, 8], [9, 0, 0, 0]])
    assert response_mask_from_ids(ids, eos).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_checkpoint_generation_config_cannot_change_what_is_sampled(trained, tmp_path):
    sft_dir, _, _ = trained
    tokenizer = load_tokenizer(sft_dir)
    prompts = [tokenizer("describe the river .", add_special_tokens=False)["input_ids"]] * 4
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    clean = generate_rollouts(load_policy(sft_dir), tokenizer, prompts, params, seed=11)
    polluted = load_policy(sft_dir)
    polluted.generation_config.repetition_penalty = 5.0
    polluted.generation_config.top_k = 2
    polluted.generation_config.min_new_tokens = 12
    assert torch.equal(generate_rollouts(polluted, tokenizer, prompts, params, seed=11).input_ids, clean.input_ids)


def test_attention_dropout_is_off_even_in_train_mode(trained, tmp_path):
    sft_dir, _, _ = trained
    copy = tmp_path / "dropout-model"
    shutil.copytree(sft_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.5}))
    model = load_policy(str(copy)).train()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    torch.manual_seed(0)
    first = model(input_ids=ids).logits
    second = model(input_ids=ids).logits
    assert torch.equal(first, second)


def test_new_scalar_head_starts_at_zero_and_a_trained_one_is_kept(trained):
    sft_dir, rm_dir, _ = trained
    fresh = load_scalar_model(sft_dir)  # causal-LM directory: the head is new
    assert torch.count_nonzero(scalar_head(fresh).weight) == 0
    reward_model = load_scalar_model(rm_dir)
    assert torch.count_nonzero(scalar_head(reward_model).weight) > 0
    ids = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    scores = sequence_scores(reward_model, ids, mask)
    # Right padding does not change a row's score: it is read at the last attended token.
    alone = sequence_scores(reward_model, ids[:1, :3], mask[:1, :3])
    assert torch.allclose(scores[0], alone[0], atol=1e-5)


def test_model_fingerprint_follows_the_weights(trained, tmp_path):
    sft_dir, _, _ = trained
    copy = tmp_path / "m"
    shutil.copytree(sft_dir, copy)
    before = model_fingerprint(str(copy))
    assert before == model_fingerprint(sft_dir)  # content, not path
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(str(copy)) != before
    assert model_fingerprint("Qwen/Qwen2-0.5B-Instruct") == "Qwen/Qwen2-0.5B-Instruct"


def test_model_path_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        resolve_model_path(str(tmp_path / "file"))
    assert resolve_model_path("Qwen/Qwen2-0.5B-Instruct") == "Qwen/Qwen2-0.5B-Instruct"


def test_a_missing_folder_that_looks_like_a_hub_id_is_named_as_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "assets/nope" does not exist here, and reads as the hub id org "assets"
    with pytest.raises(ConfigError) as raised:
        load_policy("assets/nope")
    message = str(raised.value)
    assert message.startswith("model.path 'assets/nope' could not be loaded (there is no local folder 'assets/nope',")
    assert "so it was read as a hub id): " in message
