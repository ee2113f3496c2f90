"""`rlflow probe`: a few PPO steps measured and logged to MLflow, nothing written; a GRPO probe
with a rule reward (no critic, no reward model); its memory measurement agrees with `rlflow
estimate` within 25% at ~50M parameters; bad input (DPO has no RL stage to probe)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import small_config_tree
from rlflow.flows.cli.main import main


def write_config(tmp_path: Path, small_assets: Path, **sections) -> Path:
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(small_config_tree(small_assets, tmp_path / "runs", **sections)))
    return path


def test_probe_measures_logs_and_writes_nothing(small_assets, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/probe.db"
    config = write_config(tmp_path, small_assets, tracking={"uri": uri})
    assert main(["probe", str(config), "rl.rollout_batch=8", "rl.mini_batch=8", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^  step \d: [\d.]+ s, reward", out, re.M)) == 3
    for expected in ("above the post-import baseline", "p50", "p90", "generated tokens/s", "trend per step", "USD"):
        assert expected in out, expected
    full = re.search(r"full run \((\d+) PPO steps", out)
    assert full and int(full.group(1)) == 3  # rl.steps x run.rounds of the small config
    assert not (tmp_path / "runs" / "t").exists()  # no checkpoint, no run folder
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments, "tags.`rlflow.kind` = 'probe'")
    assert run.data.tags["rlflow.run_name"] == "probe-t" and run.info.status == "FINISHED"
    assert run.data.metrics["probe/step_s_mean"] > 0 and run.data.metrics["probe/peak_rss_above_baseline_gib"] > 0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "timing_s/step")] == [1, 2, 3]
    assert run.data.params["config.rl.rollout_batch"] == "8"


RULE_REWARD = "reward.sources=[{name: len, type: length, kwargs: {target: 3}}]"


def test_a_grpo_probe_runs_the_algorithm_without_critic_or_reward_model(small_assets, tmp_path, capsys):
    config = write_config(tmp_path, small_assets, run={"threads": 1})
    grpo = ["algorithm.name=grpo", "rollout.n=2", "rl.rollout_batch=4", "rl.mini_batch=4", "sampling.max_new_tokens=6"]
    rules = [RULE_REWARD, "reward.workers=1"]  # scored in a worker process: no --reward-model needed
    assert main(["probe", str(config), *grpo, *rules, "--steps", "2", "--no-tracking", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "probing 2 GRPO (2 samples per prompt, no critic) step(s)" in out
    assert len(re.findall(r"^  step \d: [\d.]+ s, reward", out, re.M)) == 2
    phases = re.search(r"^phases \(median s\): (.*)$", out, re.M).group(1)
    assert "update_actor" in phases and "values" not in phases and "update_critic" not in phases
    assert "full run (3 GRPO steps" in out and "estimate" in out


def _fifty_million(small_assets: Path, folder: Path) -> Path:
    """A ~50M-parameter model of the demo family (random weights) with the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(small_assets / "tiny-model")),
        hidden_size=640, intermediate_size=1728, num_hidden_layers=10, num_attention_heads=10,
        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert 45e6 < sum(p.numel() for p in model.parameters()) < 55e6
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(small_assets / "tiny-model").save_pretrained(folder)
    return folder


def test_memory_estimate_is_within_25_percent_of_the_measured_peak_at_50m(small_assets, tmp_path):
    model = _fifty_million(small_assets, tmp_path / "m50")
    config = write_config(tmp_path, small_assets)
    ppo = ["rl.rollout_batch=8", "rl.mini_batch=8", "sampling.max_new_tokens=32", "rollout.generate_batch=8"]
    # A fresh process: the peak resident set is the process's, so nothing else may have run in it.
    out = subprocess.run(
        [sys.executable, "-m", "rlflow.flows.cli.main", "probe", str(config), f"model.path={model}", *ppo]
        + ["--steps", "2", "--no-tracking", "--gpu", "cpu"],
        capture_output=True, text=True, timeout=600, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"peak RSS ([\d.]+) GiB above .* estimate ([\d.]+) GiB", out.stdout)
    assert found, out.stdout
    measured, estimated = float(found.group(1)), float(found.group(2))
    assert measured > 1.5  # four 50M models, gradients and Adam: the tensors really were there
    assert 0.75 <= measured / estimated <= 1.25, (measured, estimated)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (
            [
                "resources.nproc_per_node=2",
                "engine.backend=deepspeed",
                "rollout.generate_batch=8",
                "eval.batch_size=16",
            ],
            "runs one process",
        ),
        (["--reward-model", "/nonexistent/rm"], "--reward-model '/nonexistent/rm' does not exist"),
        (["algorithm.name=dpo"], "rlflow probe runs the RL stage"),
        (
            ["algorithm.name=grpo", "rollout.n=2", RULE_REWARD, "--reward-model", "/some/rm"],
            "reward.sources has no learned reward model",
        ),
    ],
)
def test_bad_probe_input_names_the_flag_or_key(small_assets, tmp_path, capsys, args, message):
    config = write_config(tmp_path, small_assets)
    assert main(["probe", str(config), *args]) == 2
    assert message in capsys.readouterr().err


def test_the_full_run_is_extrapolated_from_the_mean_step_time(small_assets, tmp_path):
    from rlflow.engine.config.schema import build_config
    from rlflow.flows.cli.probe import extrapolate

    config = build_config(small_config_tree(small_assets, tmp_path, rl={"steps": 30}, run={"rounds": 4}), "t")
    # 30 steps x 4 rounds x 1.5 s = 180 s = 0.05 h; on 2 devices at 3.0 an hour: 0.1 device-hours, 0.3
    assert extrapolate(config, step_s=1.5, price_per_hour=3.0, gpus=2) == pytest.approx(
        {"rl_steps": 120, "hours": 0.05, "gpu_hours": 0.1, "cost": 0.3}
    )


def test_the_probe_names_what_it_runs_and_refuses_what_it_cannot(small_assets, tmp_path):
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.errors import ConfigError
    from rlflow.flows.cli.probe import check_probe_config, probed_algorithm

    config = build_config(small_config_tree(small_assets, tmp_path), "t")
    assert probed_algorithm(config) == "PPO"
    check_probe_config(config, steps=2)
    with pytest.raises(ConfigError, match="--steps must be at least 1, got 0"):
        check_probe_config(config, steps=0)
    served = build_config(small_config_tree(small_assets, tmp_path, rollout={"mode": "server"}), "t")
    with pytest.raises(ConfigError, match="set rollout.mode=colocated for the probe"):
        check_probe_config(served, steps=2)


def test_a_probe_of_an_env_config_runs_multi_turn_episodes_and_says_so(tmp_path, capsys):
    from helpers.chat_model import write_chat_model

    rows = [{"prompt": f"what is {i} plus 30", "turns": t} for i, t in enumerate([1, 2, 3, 2])]
    chat = write_chat_model(tmp_path / "chat", rows)
    tree = {
        "run": {"name": "t", "root": str(tmp_path / "runs"), "threads": 1},
        "model": {"path": str(chat / "model")},
        "data": {"prompts": str(chat / "prompts.jsonl"), "eval_prompts": str(chat / "eval_prompts.jsonl"),
                 "chat_template": "auto"},
        "algorithm": {"name": "grpo"},
        "rollout": {"n": 2},
        "rl": {"rollout_batch": 4, "mini_batch": 4, "epochs": 1},
        "reward": {"sources": [{"name": "len", "type": "length", "kwargs": {"target": 3}}], "workers": 1},
        "env": {"fn": "helpers.envs:ScriptedEnv", "max_turns": 3, "max_total_tokens": 96},
        "sampling": {"max_new_tokens": 6},
    }
    config = tmp_path / "env.yaml"
    config.write_text(yaml.safe_dump(tree))
    assert main(["probe", str(config), "--steps", "2", "--no-tracking", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "multi-turn episodes of ScriptedEnv (up to 3 turns)" in out
    assert "episodes: every prompt a multi-turn episode, 2.00 model turns on average" in out  # turns 1, 2, 3, 2
