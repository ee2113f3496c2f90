"""The pre-flight checks called one by one on small configs: each refuses a bad input with a message
that names the config key, the value and the fix, and lets a good one through."""

import json
import os
import shutil
import socket

import pytest

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import CheckpointError, ConfigError, DataError
from rlflow.flows.preflight import (
    check_backend,
    check_inputs,
    check_lora,
    check_mirror,
    check_weights_url,
    check_model,
    check_preference_sources,
    check_reward_model_vocabulary,
    check_reward_sources,
    check_run_root,
    check_tokenizer,
    probe_write,
)


def config(small_assets, root, **sections):
    return build_config(small_config_tree(small_assets, root, **sections), "t")


def test_a_prompt_and_its_response_must_fit_the_models_context(small_assets, tmp_path):
    # the tiny model's max_position_embeddings is 256
    check_model(config(small_assets, tmp_path, data={"max_prompt_tokens": 244}))  # 244 + 12 = 256 fits
    too_long = config(small_assets, tmp_path, data={"max_prompt_tokens": 250})
    with pytest.raises(ConfigError) as err:
        check_model(too_long)
    message = str(err.value)
    assert message.startswith("data.max_prompt_tokens=250 + sampling.max_new_tokens=12 = 262 tokens")
    assert "more than the model's context of 256 (max_position_embeddings of" in message
    assert message.endswith("lower one of them")


def test_a_model_folder_of_gguf_files_is_told_to_name_one(small_assets, tmp_path):
    folder = tmp_path / "gguf-model"
    folder.mkdir()
    (folder / "b.Q4.gguf").write_bytes(b"GGUF")
    (folder / "a.Q8.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as err:
        check_model(config(small_assets, tmp_path, model={"path": str(folder)}))
    message = str(err.value)
    assert f"model.path {str(folder)!r} holds GGUF file(s) (a.Q8.gguf, b.Q4.gguf) but no config.json" in message
    assert "set model.gguf_file=a.Q8.gguf" in message and "rlflow import-model" in message


def test_a_quantised_model_is_told_to_be_converted(small_assets, tmp_path):
    folder = tmp_path / "quantised"
    shutil.copytree(small_assets / "tiny-model", folder)
    hf_config = json.loads((folder / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (folder / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ConfigError) as err:
        check_model(config(small_assets, tmp_path, model={"path": str(folder)}))
    message = str(err.value)
    assert message.startswith(f"model.path {str(folder)!r}: it is quantised (bitsandbytes)")
    assert "`rlflow import-model SRC DEST`" in message and message.endswith("set model.path=DEST")


def test_a_missing_model_path_is_named(small_assets, tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=f"model.path '{missing}' does not exist"):
        check_model(config(small_assets, tmp_path, model={"path": missing}))


def test_chat_template_auto_needs_a_tokenizer_with_one(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, data={"chat_template": "auto"})
    with pytest.raises(ConfigError) as err:
        check_tokenizer(cfg, {})
    message = str(err.value)
    assert message.startswith("data.chat_template=auto, but the tokenizer of model.path")
    assert "set data.chat_template=none" in message and "chat_template to its tokenizer_config.json" in message
    check_tokenizer(config(small_assets, tmp_path), {})  # chat_template=none: prompts as written


def test_dropping_every_prompt_of_a_set_is_refused_with_the_key_of_its_file(small_assets, tmp_path):
    from rlflow.engine.data.records import load_prompts

    cfg = config(small_assets, tmp_path, data={"prompt_overflow": "drop", "max_prompt_tokens": 1})
    prompts = load_prompts(cfg.data.prompts)
    with pytest.raises(DataError) as err:
        check_tokenizer(cfg, {"prompts": prompts})
    message = str(err.value)
    assert message.startswith(f"data.prompts: {cfg.data.prompts}: every prompt is longer than data.max_prompt_tokens=1")
    assert message.endswith("raise the limit or set data.prompt_overflow=truncate")
    roomy = config(small_assets, tmp_path, data={"prompt_overflow": "drop", "max_prompt_tokens": 64})
    check_tokenizer(roomy, {"prompts": prompts})


def test_with_an_env_the_prompt_measured_is_the_episodes_first_messages_tool_instructions_included(
    small_assets, tmp_path
):
    from helpers.chat_model import write_chat_model
    from rlflow.engine.data.records import load_prompts

    chat = write_chat_model(tmp_path / "chat", [{"prompt": f"what is {i} plus 30"} for i in range(4)])
    tools = {"fn": "rlflow.engine.envs.tool_env:ToolEnv", "kwargs": {"tools": ["calculator"]}}
    files = {"prompts": str(chat / "prompts.jsonl"), "eval_prompts": str(chat / "eval_prompts.jsonl")}

    def with_limit(tokens):
        data = files | {"chat_template": "auto", "prompt_overflow": "drop", "max_prompt_tokens": tokens}
        return config(small_assets, tmp_path, model={"path": str(chat / "model")}, data=data, env=tools)

    cfg = with_limit(24)
    prompts = load_prompts(cfg.data.prompts)
    check_tokenizer(cfg.model_copy(update={"env": None}), {"prompts": prompts})  # 24 tokens hold every prompt
    with pytest.raises(DataError) as err:  # but not behind the calculator's instructions
        check_tokenizer(cfg, {"prompts": prompts})
    assert str(err.value).startswith(
        f"data.prompts: {cfg.data.prompts}: every prompt, as an episode's first messages (tool instructions"
        " included), is longer than data.max_prompt_tokens=24 and was dropped"
    )
    check_tokenizer(with_limit(2048), {"prompts": prompts})


def test_a_reward_model_with_another_vocabulary_is_refused(small_assets, tmp_path):
    from rlflow.engine.tasksets.demo import make_tokenizer

    other = tmp_path / "other-rm"
    make_tokenizer(["completely different words here", "and some more text"] * 20, vocab_size=80).save_pretrained(other)
    cfg = config(small_assets, tmp_path, rm={"init": str(other)})
    with pytest.raises(ConfigError) as err:
        check_reward_model_vocabulary(cfg)
    message = str(err.value)
    assert message.startswith(f"rm.init {str(other)!r} and model.path") and "different vocabularies" in message
    assert "set rm.init=sft" in message
    check_reward_model_vocabulary(config(small_assets, tmp_path))  # rm.init=sft: nothing to compare
    check_reward_model_vocabulary(config(small_assets, tmp_path, rm={"init": "s3://bucket/rm"}))  # not downloaded


def test_vllm_rollouts_need_their_own_python(small_assets, tmp_path):
    missing = str(tmp_path / "no-venv" / "python")
    rollout = {"mode": "server", "server_backend": "vllm", "vllm_python": missing}
    with pytest.raises(ConfigError) as err:
        check_backend(config(small_assets, tmp_path, rollout=rollout))
    message = str(err.value)
    assert message.startswith("rollout.server_backend=vllm runs in its own environment")
    assert f"rollout.vllm_python={missing!r} does not exist" in message and "`make vllm-env`" in message
    check_backend(config(small_assets, tmp_path, rollout={"mode": "server", "server_backend": "hf"}))


def test_a_run_root_that_cannot_be_written_is_named(small_assets, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    root = str(blocker / "runs")
    with pytest.raises(ConfigError, match=f"^run.root '{root}' cannot be written: "):
        check_run_root(config(small_assets, root))
    good = tmp_path / "runs"
    check_run_root(config(small_assets, good, run={"name": "free"}))
    assert not (good / "free" / ".lock").exists()  # the flow takes the lock for real, later


def test_a_run_held_by_another_live_process_is_refused(small_assets, tmp_path):
    run_dir = tmp_path / "held"
    run_dir.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "started": "2026-01-01T00:00:00Z"}
    (run_dir / ".lock").write_text(json.dumps(holder))
    with pytest.raises(CheckpointError, match=f"already being run by pid {os.getppid()}"):
        check_run_root(config(small_assets, tmp_path, run={"name": "held"}))


def test_fsspec_weights_need_a_folder_the_trainer_can_write_now(small_assets, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    fsspec = {"mode": "server", "server_backend": "vllm", "transport": "fsspec"}
    bad = config(small_assets, tmp_path, rollout=fsspec | {"weights_url": f"file://{blocker}/weights"})
    with pytest.raises(ConfigError, match=f"^rollout.weights_url 'file://{blocker}/weights' cannot be written: "):
        check_weights_url(bad)
    good = tmp_path / "weights"
    check_weights_url(config(small_assets, tmp_path, rollout=fsspec | {"weights_url": f"file://{good}"}))
    assert good.is_dir() and os.listdir(good) == []
    check_weights_url(config(small_assets, tmp_path))  # shared memory: nothing to write


def test_a_mirror_must_take_a_write_now(small_assets, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    mirror = str(blocker / "mirror")
    with pytest.raises(ConfigError, match=f"^checkpoint.mirror '{mirror}' cannot be written: "):
        check_mirror(config(small_assets, tmp_path, checkpoint={"mirror": mirror}))
    good = tmp_path / "mirror"
    check_mirror(config(small_assets, tmp_path, run={"name": "m"}, checkpoint={"mirror": str(good)}))
    assert (good / "m").is_dir() and os.listdir(good / "m") == []  # the probe file is deleted again
    probe_write(str(tmp_path / "probe-here"), {})
    assert os.listdir(tmp_path / "probe-here") == []


def test_a_reward_function_that_does_not_import_is_named_by_its_source(small_assets, tmp_path):
    def config_with(sources):  # no learned reward model: the critic starts from the policy
        return config(small_assets, tmp_path, reward={"sources": sources}, ppo={"critic_init": "policy"})

    sources = [{"name": "bonus", "type": "function", "fn": "rlflow.engine.tasksets.demo:no_such_function"}]
    with pytest.raises(ConfigError) as err:
        check_reward_sources(config_with(sources))
    assert str(err.value).startswith("reward.sources[bonus].fn: module 'rlflow.engine.tasksets.demo' has no function")
    missing = str(tmp_path / "no-rm")
    model = [{"name": "judge", "type": "model", "path": missing}]
    with pytest.raises(ConfigError, match=rf"^reward.sources\[judge\].path '{missing}' does not exist"):
        check_reward_sources(config_with(model))


def test_lora_target_modules_are_checked_against_the_architecture(small_assets, tmp_path):
    bad = config(small_assets, tmp_path, model={"lora": {"target_modules": ["q_proj", "qkv"]}})
    with pytest.raises(ConfigError) as err:
        check_lora(bad)
    message = str(err.value)
    assert message.startswith("model.lora.target_modules: qkv is not a linear module of LlamaForCausalLM")
    assert "q_proj" in message and '(or use "all-linear")' in message
    check_lora(config(small_assets, tmp_path, model={"lora": {"target_modules": ["q_proj", "v_proj"]}}))
    check_lora(config(small_assets, tmp_path))  # no model.lora: nothing to check


def test_a_learner_with_no_pairs_to_train_or_measure_on_is_refused(small_assets, tmp_path):
    no_prefs = config(small_assets, tmp_path, data={"preferences": None})
    with pytest.raises(ConfigError) as err:
        check_preference_sources(no_prefs, reward_model=True)
    assert str(err.value) == (
        "data.preferences is null and label.online_from_round=1: the reward model of round 0 has no pairs to"
        " train on; name a preference file or set label.online_from_round=0"
    )
    check_preference_sources(no_prefs, reward_model=False)  # PPO without a learned reward needs none
    online = config(small_assets, tmp_path, data={"preferences_eval": None}, label={"online_from_round": 0})
    with pytest.raises(ConfigError, match="^data.preferences_eval is null: the reward model would have no held-out"):
        check_preference_sources(online, reward_model=True)
    held_out = config(
        small_assets, tmp_path, data={"preferences_eval": None}, label={"online_from_round": 0, "eval_fraction": 0.2}
    )
    check_preference_sources(held_out, reward_model=True)  # the online pairs' held-out share measures it
    dpo = config(small_assets, tmp_path, algorithm={"name": "dpo"}, data={"preferences_eval": None})
    with pytest.raises(ConfigError, match="^data.preferences_eval is null: DPO measures its held-out accuracy"):
        check_preference_sources(dpo, reward_model=False)


def test_all_checks_pass_on_the_small_config_and_a_broken_data_file_is_named(small_assets, tmp_path):
    check_inputs(config(small_assets, tmp_path / "runs"))
    broken = tmp_path / "sft.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    with pytest.raises(DataError) as err:
        check_inputs(config(small_assets, tmp_path / "runs", data={"sft": str(broken)}))
    assert str(err.value).startswith(f"data.sft: {broken}")
