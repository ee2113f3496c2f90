"""LoRA through peft (engine/models/lora.py): parameter counts, the base model with adapters switched
off, SFT and reward-model stages that train only adapters, their adapter-only checkpoints,
exact resume, and a merged export that plain transformers loads."""

import json
import os
import shutil

import pytest
import torch
from conftest import RecordingSink, rm_inputs, sft_inputs, small_config_tree
from helpers.stage_ctx import make_ctx as sft_rm_ctx
from helpers.stage_ctx import run
from safetensors import safe_open

from rlflow.engine.backend.runtime import LossParts, OptimSpec, Runtime
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.config.model import LoraConfig
from rlflow.engine.config.schema import build_config
from rlflow.engine.data.batching import encode_pair, right_pad
from rlflow.engine.data.records import load_sft_examples
from rlflow.engine.errors import ConfigError
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer, scalar_head
from rlflow.engine.models.lora import (
    POINTER,
    adapters_disabled,
    apply_lora,
    is_lora_model,
    load_lora_dir,
    merge_into_base,
    merged_named_parameters,
    save_lora_dir,
    trainable_parameters,
)
from rlflow.engine.stages.sft import response_token_loss
from rlflow.engine.storage.export import ModelCard, export_policy

LORA = {"r": 4, "alpha": 8.0}
SFT = {"max_steps": 6, "eval_every": 3, "log_every": 1, "patience": 10, "batch_size": 16, "lr": 1e-2}


def make_ctx(root, stage, every=2, sink=None):
    return sft_rm_ctx(root, stage, every=every, sink=sink)  # a checkpoint every 2 steps: resume points


def batch(seed=0):
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model):
    with torch.no_grad():
        return model.eval()(**batch()).logits


def hand_count(config, r, targets):
    """r x (in + out) per targeted linear of each layer, from the model's config."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    return config.num_hidden_layers * sum(r * sum(shapes[t]) for t in targets)


@pytest.fixture(scope="module")
def lora_sft(small_assets, tmp_path_factory):
    """A finished LoRA SFT stage: (config, its StageOutcome, run root)."""
    root = tmp_path_factory.mktemp("lora-sft")
    cfg = build_config(small_config_tree(small_assets, root, sft=SFT, model={"lora": LORA}), "t")
    return cfg, run(make_ctx(root, "sft"), sft_inputs(cfg)), root


def test_trainable_parameter_counts_match_the_hand_count(small_assets):
    base = str(small_assets / "tiny-model")
    policy = apply_lora(load_policy(base), LoraConfig(r=4))
    expected = hand_count(policy.config, 4, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert expected == 2 * 4 * 4 * (128 + 128)  # the tiny model: 2 layers, hidden 128, 4 x 32 heads
    trainable, total = trainable_parameters(policy)
    assert trainable == expected and total == trainable_parameters(load_policy(base))[1] + expected
    assert all("lora_" in n for n, p in policy.named_parameters() if p.requires_grad)
    # A reward model or critic also trains its scalar head (hidden -> 1).
    scalar = apply_lora(load_scalar_model(base), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert trainable_parameters(scalar)[0] == hand_count(scalar.config, 2, ["q_proj", "v_proj"]) + 128
    # The optimizer sees exactly the trainable tensors.
    engine = Runtime(EngineConfig()).trainable(
        "m", lambda: load_policy(base), OptimSpec(1e-3, 0.0, 0, 0, 1.0), lora=LoraConfig(r=4)
    )
    optimized = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == expected and all(n.count("lora_") for n in engine.param_names())
    with pytest.raises(ConfigError, match=r"qkv is not a linear module .* down_proj, gate_proj, k_proj, o_proj"):
        apply_lora(load_policy(base), LoraConfig(target_modules=["q_proj", "qkv"]))


def test_adapters_disabled_is_the_base_model_and_merging_is_exact(small_assets):
    base = str(small_assets / "tiny-model")
    expected = logits(load_policy(base))
    model = apply_lora(load_policy(base), LoraConfig(r=4))
    with torch.no_grad():  # a trained-looking adapter: B starts at zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    adapted = logits(model)
    assert (adapted - expected).abs().max() > 1e-3
    with adapters_disabled(model):
        assert torch.equal(logits(model), expected)
    assert torch.equal(logits(model), adapted)  # switched back on
    # What a weight sync sends equals what merging gives, bit for bit, under the plain names.
    synced = dict(merged_named_parameters(model))
    merged = merge_into_base(model)
    assert not is_lora_model(merged) and synced.keys() == dict(merged.named_parameters()).keys()
    assert all(torch.equal(synced[name], param) for name, param in merged.named_parameters())
    torch.testing.assert_close(logits(merged), adapted, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        adapters_disabled(merged).__enter__()


def test_modules_to_save_trains_the_tied_embedding_and_head_as_one_tensor(small_assets, tmp_path):
    base = str(small_assets / "tiny-model")
    expected = logits(load_policy(base))
    cfg = LoraConfig(r=4, modules_to_save=["embed_tokens"])
    model = apply_lora(load_policy(base), cfg)
    inner = model.get_base_model()
    embedding = inner.model.embed_tokens.modules_to_save["default"].weight
    assert embedding.requires_grad and inner.lm_head.weight is embedding  # still tied: one trained tensor
    assert trainable_parameters(model)[0] == hand_count(model.config, 4, ["q_proj", "k_proj", "v_proj", "o_proj"]) + (
        embedding.numel()
    )
    with torch.no_grad():
        embedding.add_(0.05 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(2)))
    adapted = logits(model)
    assert (adapted - expected).abs().max() > 1e-3
    with adapters_disabled(model):  # the reference: the original embedding and head
        assert torch.equal(logits(model), expected)
    save_lora_dir(model, load_tokenizer(base), str(tmp_path / "lora"))
    loaded = load_policy(str(tmp_path / "lora"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(logits(loaded), adapted, rtol=0, atol=1e-5)
    synced = dict(merged_named_parameters(model))
    assert synced.keys() == dict(loaded.named_parameters()).keys()
    torch.testing.assert_close(synced["model.embed_tokens.weight"], loaded.model.embed_tokens.weight, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="embed_token is not a module with weights"):
        apply_lora(load_policy(base), LoraConfig(r=4, modules_to_save=["embed_token"]))
    with pytest.raises(ConfigError, match="q_proj is also in model.lora.target_modules"):
        apply_lora(load_policy(base), LoraConfig(r=4, modules_to_save=["q_proj"]))


def test_sft_trains_only_adapters(small_assets):
    cfg = build_config(small_config_tree(small_assets, small_assets, sft=SFT), "t")
    tokenizer = load_tokenizer(cfg.model.path)
    rows = [encode_pair(tokenizer, ex.prompt, ex.response, 64) for ex in load_sft_examples(cfg.data.sft)[:16]]
    engine = Runtime(EngineConfig()).trainable(
        "model", lambda: load_policy(cfg.model.path), OptimSpec(1e-2, 0.0, 0, 0, 1.0), lora=LoraConfig(**LORA)
    )
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    ids, attention, mask = right_pad(rows, tokenizer.pad_token_id)
    loss_fn = lambda model, b: LossParts(*response_token_loss(model, *b))  # noqa: E731
    for _ in range(2):
        engine.train_step([(ids, attention, mask)], [float(mask[:, 1:].sum())], loss_fn)
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], before) for n, before in frozen.items())
    assert all(not torch.equal(params[n], before) for n, before in adapters.items() if "lora_B" in n)


def test_lora_sft_checkpoint_holds_adapters_and_loads_back(lora_sft):
    cfg, outcome, _ = lora_sft
    model_dir = f"{outcome.checkpoint_uri}/model"
    files = set(os.listdir(model_dir))
    assert {"adapter_model.safetensors", "adapter_config.json", POINTER, "config.json", "tokenizer.json"} <= files
    assert not any(f.startswith("model") for f in files)  # no full weights
    pointer = json.load(open(f"{model_dir}/{POINTER}"))
    assert pointer["base"]["path"] == cfg.model.path and pointer["base"]["fingerprint"].startswith("sha256:")
    # The optimizer shards hold the adapters only, keyed by parameter name.
    with safe_open(f"{outcome.checkpoint_uri}/optim/model.rank00000.safetensors", "pt") as shard:
        masters = {k.removesuffix("::master"): shard.get_tensor(k) for k in shard.keys() if k.endswith("::master")}
    assert masters and all("lora_" in name for name in masters)
    # Base + the shard's trained adapters = the adapter directory loaded back, bit for bit.
    rebuilt = apply_lora(load_policy(cfg.model.path), LoraConfig(**LORA))
    with torch.no_grad():
        for name, param in rebuilt.named_parameters():
            if name in masters:
                param.copy_(masters[name])
    unmerged = load_lora_dir(model_dir, load_policy, merge=False)
    assert torch.equal(logits(unmerged), logits(rebuilt))
    merged = load_policy(model_dir)  # what the next stage, evaluation and rollouts load
    assert not is_lora_model(merged)
    torch.testing.assert_close(logits(merged), logits(rebuilt), rtol=0, atol=1e-5)


def test_lora_sft_resumes_exactly(lora_sft, tmp_path):
    cfg, outcome, root = lora_sft
    shutil.copytree(root / "sft", tmp_path / "sft")
    # As if killed right after committing step 4: the later step and the final marker are gone.
    shutil.rmtree(tmp_path / "sft" / "step_000006")
    (tmp_path / "sft" / "final.json").unlink()
    sink = RecordingSink()
    resumed = run(make_ctx(tmp_path, "sft", sink=sink), sft_inputs(cfg))
    assert resumed.resumed_from == 4 and [s for s, _ in sink.series("sft/loss")] == [5, 6]
    base_params = trainable_parameters(load_policy(cfg.model.path))[1]
    adapters = 2 * 4 * 4 * (128 + 128)  # as in the hand count above: r 4 on q/k/v/o of 2 layers
    assert sink.series("lora/policy/trainable_params") == [(0, adapters)]  # logged for MLflow at step 0
    assert sink.series("lora/policy/params") == [(0, base_params + adapters)]
    model_files = sorted(f"model/{f}" for f in os.listdir(f"{outcome.checkpoint_uri}/model"))
    for name in model_files + ["optim/model.rank00000.safetensors"]:  # every byte, adapter_config.json too
        with open(f"{outcome.checkpoint_uri}/{name}", "rb") as a, open(f"{resumed.checkpoint_uri}/{name}", "rb") as b:
            assert a.read() == b.read(), name


def test_a_stage_training_the_embedding_whole_resumes_exactly_and_stays_tied(small_assets, tmp_path):
    lora = LORA | {"modules_to_save": ["embed_tokens"]}
    cfg = build_config(small_config_tree(small_assets, tmp_path, sft=SFT, model={"lora": lora}), "t")
    done = run(make_ctx(tmp_path / "a", "sft"), sft_inputs(cfg))
    shutil.copytree(tmp_path / "a" / "sft", tmp_path / "b" / "sft")
    shutil.rmtree(tmp_path / "b" / "sft" / "step_000006")  # killed right after committing step 4
    (tmp_path / "b" / "sft" / "final.json").unlink()
    resumed = run(make_ctx(tmp_path / "b", "sft"), sft_inputs(cfg))
    assert resumed.resumed_from == 4
    for name in ("model/adapter_model.safetensors", "optim/model.rank00000.safetensors"):
        with open(f"{done.checkpoint_uri}/{name}", "rb") as a, open(f"{resumed.checkpoint_uri}/{name}", "rb") as b:
            assert a.read() == b.read(), name
    policy = load_policy(f"{resumed.checkpoint_uri}/model")
    base = load_policy(cfg.model.path)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # still one tensor after merging
    assert not torch.equal(policy.model.embed_tokens.weight, base.model.embed_tokens.weight)  # and it trained


def test_lora_reward_model_stacks_on_the_sft_adapters(lora_sft, small_assets, tmp_path):
    cfg, sft, _ = lora_sft
    sft_dir = f"{sft.checkpoint_uri}/model"
    data = {}
    for name, rows in (("preferences", 128), ("preferences_eval", 32)):  # a few steps are enough here
        lines = (small_assets / "data" / f"{name}.jsonl").read_text().splitlines()[:rows]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        data[name] = str(tmp_path / f"{name}.jsonl")
    rm = {"epochs": 1, "batch_size": 32, "norm_samples": 16, "lr": 1e-2, "warmup_steps": 0}
    tree = small_config_tree(small_assets, tmp_path, rm=rm, data=data, model={"lora": LORA})
    rm_cfg = build_config(tree, "t")
    outcome = run(make_ctx(tmp_path, "rm", every=100), rm_inputs(rm_cfg, sft_dir))
    rm_dir = f"{outcome.checkpoint_uri}/model"
    pointer = json.load(open(f"{rm_dir}/{POINTER}"))
    assert pointer["adapters"] == ["parents/00", "."] and pointer["base"]["path"] == cfg.model.path
    assert os.path.isfile(f"{rm_dir}/parents/00/adapter_model.safetensors")
    with safe_open(f"{rm_dir}/adapter_model.safetensors", "pt") as f:
        assert any("score" in k for k in f.keys())  # the trained head travels with the adapters
    reward_model = load_scalar_model(rm_dir)
    assert torch.count_nonzero(scalar_head(reward_model).weight) > 0
    # Adapters switched off: the SFT model with the fresh (zero) head the stage started from.
    start = apply_lora(load_scalar_model(sft_dir), LoraConfig(**LORA))
    with adapters_disabled(start):
        assert torch.count_nonzero(scalar_head(start).weight) == 0
    assert outcome.metrics["rm/loss"] < 0.69, outcome.metrics  # below log 2, where the zero head starts


def test_export_merges_adapters_into_a_plain_transformers_model(lora_sft, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg, outcome, _ = lora_sft
    card = ModelCard("exp", 0, "sft", outcome.checkpoint_uri, cfg.model.path)
    result = export_policy(outcome.checkpoint_uri, {}, str(tmp_path / "out"), {}, card)
    assert "model.safetensors" in result.files and not any("adapter" in f for f in result.files)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    unmerged = load_lora_dir(f"{outcome.checkpoint_uri}/model", load_policy, merge=False)
    torch.testing.assert_close(logits(exported), logits(unmerged), rtol=0, atol=1e-5)


def test_base_model_gone_or_changed_and_deepspeed_are_clear_errors(small_assets, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(small_assets / "tiny-model", base)
    tokenizer = load_tokenizer(str(base))
    save_lora_dir(apply_lora(load_policy(str(base)), LoraConfig(r=2)), tokenizer, str(tmp_path / "lora"))
    assert load_policy(str(tmp_path / "lora")).config.model_type == "llama"
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"initializer_range": 0.03}))
    with pytest.raises(ConfigError, match="weights changed since"):
        load_policy(str(tmp_path / "lora"))
    shutil.rmtree(base)
    with pytest.raises(ConfigError, match="does not exist here"):
        load_policy(str(tmp_path / "lora"))
    tree = small_config_tree(small_assets, tmp_path, model={"lora": LORA}, engine={"backend": "deepspeed"})
    with pytest.raises(ConfigError, match="model.lora needs engine.backend=torch"):
        build_config(tree, "t")
