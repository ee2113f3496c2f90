"""Export of a committed policy as a clean Hugging Face directory (local and S3) and its model card."""

import json
import os
import shutil

import pytest
import torch

from conftest import sft_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import CheckpointError, ConfigError
from rlflow.engine.storage.export import ExportResult, ModelCard, export_policy

TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}
CLEAN = {"config.json", "generation_config.json", "model.safetensors", "README.md"} | TOKENIZER_FILES


def card(step_uri="runs/r/round_0/sft/step_000003", **changes):
    fields = dict(
        run_name="exp1",
        round_index=1,
        stage="ppo",
        step_uri=step_uri,
        base_model="Qwen/Qwen2-0.5B-Instruct",
        lineage={
            "mlflow_parent_run_id": "abc123",
            "reward_model": "runs/r/round_1/rm/step_000040",
            "data": "sha256:f00",
        },
        evaluation=[
            {"round": 0, "gold_score_before": 0.123456, "gold_score_after": 0.5, "kl": 0.0123456},
            {"round": 1, "gold_score_before": 0.5, "gold_score_after": 0.81234, "kl": 1234.5678, "rm_accuracy": 0.7},
        ],
    )
    return ModelCard(**(fields | changes))


@pytest.fixture(scope="module")
def sft_steps(small_assets, tmp_path_factory):
    """A 3-step SFT stage run for real: steps 1..3 committed, 2 and 3 holding a whole model."""
    root = tmp_path_factory.mktemp("export")
    cfg = build_config(small_config_tree(small_assets, root, sft={"max_steps": 3, "eval_every": 3}), "t")
    store = CheckpointStore(f"{root}/exp1/round_0/sft")
    ctx = make_ctx(root, "sft", "x", 1, store=store, keep_last=3, consolidate_every=2)
    outcome = run(ctx, sft_inputs(cfg))
    assert store.committed_steps() == [1, 2, 3] and outcome.checkpoint_uri == store.step_url(3)
    return store


def greedy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(["tell me about the village .", "what is the storm like ?"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out.tolist(), model.generation_config


def test_export_local_is_clean_and_generates_like_the_checkpoint(sft_steps, tmp_path):
    step_uri = sft_steps.step_url(3)
    dest = tmp_path / "out" / "policy"
    result = export_policy(step_uri, {}, str(dest), {}, card(step_uri))
    assert isinstance(result, ExportResult) and result.dest == str(dest)
    assert set(result.files) == CLEAN and list(result.files) == sorted(result.files)
    assert sorted(os.listdir(dest)) == list(result.files)
    assert sorted(os.listdir(dest.parent)) == ["policy"]  # no staging debris beside it
    assert result.total_bytes == sum(os.path.getsize(dest / f) for f in result.files)
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in result.files)
    source = f"{sft_steps.local_dir(3)}/model"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dest))
    assert result.n_params == model.num_parameters() > 0
    reference = AutoModelForCausalLM.from_pretrained(source).state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in model.state_dict().items())
    assert greedy(str(dest))[0] == greedy(source)[0]
    readme = (dest / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: transformers\n") and step_uri in readme


def test_export_sharded_with_sampling_defaults_from_a_plain_dir(sft_steps, tmp_path):
    # A plain HF directory without generation_config.json: one is built from the tokenizer.
    source = tmp_path / "plain"
    shutil.copytree(f"{sft_steps.local_dir(2)}/model", source)
    os.remove(source / "generation_config.json")
    dest = tmp_path / "sharded"
    sampling = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 64}
    result = export_policy(str(source), {}, str(dest), {}, card(), sampling=sampling, max_shard_size="500KB")
    shards = [f for f in result.files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors" not in result.files
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    gen = json.loads((dest / "generation_config.json").read_text())
    assert gen | sampling == gen and gen["do_sample"] is True
    assert gen["eos_token_id"] == 1 and gen["pad_token_id"] == 0  # the demo tokenizer's <eos>, <pad>
    assert greedy(str(dest))[0] == greedy(str(source))[0]


def test_export_to_s3_then_load(sft_steps, s3_bucket, tmp_path):
    import s3fs

    url, options = s3_bucket
    dest = f"{url}/exports/exp1"
    result = export_policy(sft_steps.step_url(3), {}, dest, options, card(), sampling={"temperature": 0.8})
    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(dest)) == list(result.files) == sorted(CLEAN)
    fs.get(f"{dest}/", str(tmp_path / "down") + "/", recursive=True)
    tokens, gen = greedy(str(tmp_path / "down"))
    assert tokens == greedy(f"{sft_steps.local_dir(3)}/model")[0] and gen.temperature == 0.8
    with pytest.raises(ConfigError, match=f"export dest {dest} is not empty"):
        export_policy(sft_steps.step_url(3), {}, dest, options, card())
    # Overwrite with a sharded export: the old single file goes, config.json is back last.
    again = export_policy(sft_steps.step_url(3), {}, dest, options, card(), max_shard_size="500KB", overwrite=True)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(dest)) == list(again.files)
    assert "model.safetensors" not in again.files and "config.json" in again.files


def test_export_from_a_step_on_s3(sft_steps, s3_bucket, tmp_path):
    url, options = s3_bucket
    remote = CheckpointStore(f"{url}/runs/exp1/round_0/sft", options)
    remote.copy_step_from(sft_steps, 3)
    result = export_policy(remote.step_url(3), options, str(tmp_path / "out"), {}, card())
    assert set(result.files) == CLEAN
    assert greedy(str(tmp_path / "out"))[0] == greedy(f"{sft_steps.local_dir(3)}/model")[0]


def test_refuses_uncommitted_unconsolidated_and_non_policy_sources(sft_steps, tmp_path):
    dest = str(tmp_path / "out")
    missing = f"{sft_steps.url}/step_000007"
    with pytest.raises(CheckpointError, match=rf"step {missing} is not committed; committed steps of .*: \[1, 2, 3\]"):
        export_policy(missing, {}, dest, {}, card())
    with pytest.raises(CheckpointError, match=r"step_000001 holds optimizer shards but no whole model.*\[2, 3\]"):
        export_policy(sft_steps.step_url(1), {}, dest, {}, card())
    with pytest.raises(ConfigError, match="'nowhere/step_30' is neither a checkpoint step URI"):
        export_policy("nowhere/step_30", {}, dest, {}, card())
    # A reward model's directory has no LM head: exporting it as a policy would be random weights.
    rm_dir = tmp_path / "rm"
    shutil.copytree(f"{sft_steps.local_dir(3)}/model", rm_dir)
    config = json.loads((rm_dir / "config.json").read_text())
    (rm_dir / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="LlamaForSequenceClassification model, not a causal-LM policy"):
        export_policy(str(rm_dir), {}, dest, {}, card())
    with pytest.raises(ConfigError, match=r"sampling.top_p=1.5 is invalid"):
        export_policy(sft_steps.step_url(3), {}, dest, {}, card(), sampling={"top_p": 1.5})
    assert not os.path.exists(dest) and os.listdir(tmp_path) == ["rm"]  # nothing half-written


def test_refuses_a_non_empty_local_dest_unless_overwrite(sft_steps, tmp_path):
    dest = tmp_path / "policy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"export dest {dest} is not empty .*notes.txt.*overwrite=True"):
        export_policy(sft_steps.step_url(3), {}, str(dest), {}, card())
    assert os.listdir(dest) == ["notes.txt"]
    result = export_policy(sft_steps.step_url(3), {}, str(dest), {}, card(), overwrite=True)
    assert sorted(os.listdir(dest)) == list(result.files) and "notes.txt" not in result.files
    assert os.listdir(tmp_path) == ["policy"]
    (tmp_path / "empty").mkdir()  # an empty directory is fine to export into
    assert set(export_policy(sft_steps.step_url(3), {}, str(tmp_path / "empty"), {}, card()).files) == CLEAN
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        export_policy(sft_steps.step_url(3), {}, str(tmp_path / "file"), {}, card(), overwrite=True)


def test_card_render_values():
    text = card().render()
    front, body = text.split("---\n")[1], text.split("---\n", 2)[2]
    assert front == "library_name: transformers\ntags:\n- rlhf\n- ppo\n- rlflow\n"
    assert "# exp1: round 1 ppo policy" in body
    assert "| mlflow_parent_run_id | abc123 |" in body
    assert "| reward_model | runs/r/round_1/rm/step_000040 |" in body
    assert "| checkpoint | runs/r/round_0/sft/step_000003 |" in body
    assert "| base model | Qwen/Qwen2-0.5B-Instruct |" in body
    # Columns in first-seen order; floats to 4 significant digits; a missing cell stays empty.
    assert (
        "| round | gold_score_before | gold_score_after | kl | rm_accuracy |\n| --- | --- | --- | --- | --- |" in body
    )
    assert "| 0 | 0.1235 | 0.5 | 0.01235 |  |" in body
    assert "| 1 | 0.5 | 0.8123 | 1235 | 0.7 |" in body
    assert 'AutoModelForCausalLM.from_pretrained("path/to/this/model")' in body
    assert card().render() == text  # pure
    empty = card(lineage={"note": "a|b\nc"}, evaluation=[]).render()
    assert "| note | a\\|b c |" in empty and "No evaluation was recorded." in empty
