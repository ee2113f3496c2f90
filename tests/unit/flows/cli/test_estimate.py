"""`rlflow estimate`: the demo config on this CPU (fixed calibration), a 7B on A100s, bad input."""

import json
from pathlib import Path

import pytest

import rlflow.flows.cli.estimate as estimate_cli
from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.hardware import CpuCalibration
from rlflow.flows.cli.main import main

DEMO = str(Path(__file__).parents[4] / "configs" / "demo.yaml")
TINY_CONFIG = {  # demo_assets/tiny-model/config.json (the folder itself is generated, not committed)
    "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 256, "vocab_size": 351, "tie_word_embeddings": True,
}  # fmt: skip


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    """A model folder holding only config.json (all the estimator reads) and a fixed CPU calibration."""
    monkeypatch.setattr(estimate_cli, "measure_cpu", lambda: CpuCalibration(0.138, 11.2, 23.6))
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder


def run_json(capsys, *argv):
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_config_on_the_cpu_prints_memory_time_cost_and_advice(tiny_model, capsys):
    assert main(["estimate", DEMO, f"model.path={tiny_model}", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu (23.6 GiB, 0.138 TFLOP/s fp32, 11.2 GB/s measured now" in out
    assert "as configured: torch backend on 1 device (fp32)" in out
    for line in ("memory per GPU (GiB)", "KV cache", "time per PPO step (s)", "30 steps:", "USD"):
        assert line in out
    assert "recommendation: keep it - torch backend on 1 device" in out


def test_json_holds_the_same_estimate(tiny_model, capsys):
    report = run_json(capsys, DEMO, f"model.path={tiny_model}", "--gpu", "cpu")
    configured = report["configured"]
    assert configured["fits"] and configured["peak_phase"] in configured["memory_gib"]
    steps = configured["step_seconds"]
    assert steps["total"] == steps["sequential"] and not steps["overlapped"]  # synchronous sampling
    phases = [v for k, v in steps.items() if k not in ("total", "sequential", "overlapped")]
    assert steps["total"] == pytest.approx(sum(phases))
    assert configured["gpu_hours"] == pytest.approx(steps["total"] * 30 / 3600)
    assert report["workload"]["actor"]["hidden_size"] == 128 and report["workload"]["prompt_tokens"] == 32
    assert report["recommended"]["strategy"]["zero_stage"] == 0


def test_a_7b_policy_on_a100s_is_advised_a_zero_plan(tiny_model, capsys):
    report = run_json(capsys, DEMO, "rollout.generate_batch=8", "--model", "7B", "--gpu", "a100-80g")
    assert not report["configured"]["fits"]  # the demo's torch backend: one fp32 process
    best = report["recommended"]
    assert best["fits"] and best["strategy"]["zero_stage"] >= 1 and best["currency"] == "USD"
    assert report["recommendation"].startswith(best["strategy"]["label"])


def test_resources_gpu_type_picks_the_device(tiny_model, capsys):
    report = run_json(capsys, DEMO, f"model.path={tiny_model}", "resources.gpu_type=h100-80g")
    assert report["device"]["name"] == "h100-80g"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "a100"], r"unknown GPU type 'a100' \(--gpu\); valid types in .*prices.yaml: cpu, a10g-24g"),
        (["--model", "no/such/folder"], "neither a local model folder nor a size like 7B"),
        (["--zero", "0", "--gpus", "2"], "--zero 0 is the torch backend"),
        (["--zero", "2", "--offload", "all"], "needs ZeRO stage 3"),
        (["--gpus", "64", "--zero", "3"], "--gpus 64: rl.mini_batch=32 is below 64 ranks"),
        (["ppo.stepz=3"], "unknown key 'ppo.stepz'"),
    ],
)
def test_bad_input_is_one_line_naming_it(tiny_model, capsys, argv, message):
    import re

    assert main(["estimate", DEMO, f"model.path={tiny_model}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlflow: error: ") and re.search(message, err), err


def test_a_model_folder_without_config_json_is_named(tiny_model, tmp_path, capsys):
    (tmp_path / "weights-only").mkdir()
    assert main(["estimate", DEMO, "--model", str(tmp_path / "weights-only"), "--gpu", "cpu"]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_a_grpo_config_says_what_it_estimates(tiny_model, capsys):
    grpo = ["algorithm.name=grpo", "rollout.n=4", "rl.rollout_batch=16", "rl.mini_batch=8"]
    assert main(["estimate", DEMO, f"model.path={tiny_model}", *grpo, "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "algorithm: GRPO: 16 prompts x 4 samples = 64 rows per step, no critic, KL in the loss" in out
    assert "GRPO is critic-free" in out and "critic weights" not in out and "time per GRPO step (s)" in out
    # the demo's reward reads its reward model, a valid rule and a judge: a rule alone leaves none of them
    rules = ["reward.sources=[{name: len, type: length, kwargs: {target: 5}}]", "reward.valid=null"]
    rules += ["reward.judge=null", "hacking.enabled=false", "reward.uncertainty_penalty=0"]
    report = run_json(capsys, DEMO, f"model.path={tiny_model}", *grpo, *rules, "--gpu", "cpu")
    assert report["algorithm"] == "grpo" and report["workload"]["critic"] is None
    assert report["workload"]["reward"] is None and report["configured"]["memory_gib"]["scoring"]["reward_weights"] == 0


def test_a_dpo_config_is_estimated_from_its_preference_pairs(tiny_model, tmp_path, capsys):
    pair = {"prompt": "p", "chosen": "a", "rejected": "b"}
    (tmp_path / "prefs.jsonl").write_text("\n".join(json.dumps(p) for p in (pair, pair, pair | {"rejected": "a"})))
    (tmp_path / "eval.jsonl").write_text(json.dumps(pair))
    data = [f"data.preferences={tmp_path / 'prefs.jsonl'}", f"data.preferences_eval={tmp_path / 'eval.jsonl'}"]
    dpo = ["algorithm.name=dpo", "hacking.enabled=false", "label.online_from_round=null", "dpo.batch_size=2", *data]
    assert main(["estimate", DEMO, f"model.path={tiny_model}", *dpo, "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out  # the tied pair carries no preference: 2 pairs, 1 step per epoch
    assert "algorithm: DPO: 2 pairs x 1 epoch(s) = 1 step(s) of 2 pairs, reference pass once over 3 pairs" in out
    assert "time per DPO step (s)" in out and "reference pass, once:" in out and "\n    generation" not in out
    report = run_json(capsys, DEMO, f"model.path={tiny_model}", *dpo, "--pairs", "100", "--gpu", "cpu")
    configured = report["configured"]
    assert report["algorithm"] == "dpo" and set(configured["memory_gib"]) == {"reference", "training"}
    assert configured["steps"] == 50 and configured["setup_seconds"] > 0
    assert configured["total_hours"] == pytest.approx(
        (configured["step_seconds"]["total"] * 50 + configured["setup_seconds"]) / 3600
    )
    dpo_7b = ["algorithm.name=dpo", "hacking.enabled=false", "--reward-model", "7B", "--pairs", "9"]
    assert main(["estimate", DEMO, *dpo_7b]) == 2
    assert "trains without a reward model" in capsys.readouterr().err


def test_a_lora_config_counts_its_adapters_and_stays_on_one_device(tiny_model, capsys):
    lora = "model.lora={r: 16, target_modules: all-linear, modules_to_save: [embed_tokens], stages: [rm, rl]}"
    bf16 = "model.dtype=bfloat16"
    assert main(["estimate", DEMO, f"model.path={tiny_model}", bf16, lora, "--model", "8B", "--gpu", "h100-80g"]) == 0
    out = capsys.readouterr().out
    # Llama-3.1-8B: 32 x 16 x (2 x 8192 + 2 x 5120 + 3 x (4096 + 14336)) = 41.9M adapters + its untied
    # 128256 x 4096 = 525.3M embedding; the critic adds its score head, has no LM head to tie
    assert "LoRA r=16 on all-linear + embed_tokens: actor 0.57B of 8.03B, critic 0.57B of 7.50B trainable" in out
    assert "the reference is the actor with adapters off (no copy)" in out
    assert "recommendation: keep it - torch backend on 1 device" in out and "(1 plans compared" in out
    assert main(["estimate", DEMO, f"model.path={tiny_model}", lora, "--zero", "3", "--gpus", "2"]) == 2
    assert "--zero 3: model.lora trains on the torch backend only" in capsys.readouterr().err


def test_a_first_positional_that_is_an_override_reads_the_defaults_with_it():
    config = estimate_cli.read_config("rl.steps=7", ["run.rounds=2"])
    assert (config.rl.steps, config.run.rounds) == (7, 2)


def test_the_rollout_engine_and_its_own_gpus_follow_the_flags_or_the_config():
    config = estimate_cli.read_config(None, [])
    assert estimate_cli.rollout_setup(config, None, None) == ("hf", 0)  # colocated: HF on the training GPUs
    assert estimate_cli.rollout_setup(config, "vllm", 2) == ("vllm", 2)
    with pytest.raises(ConfigError, match="--rollout-gpus needs --rollout vllm"):
        estimate_cli.rollout_setup(config, "hf", 1)


def test_pairs_given_on_the_command_line_are_used_as_they_are():
    config = estimate_cli.read_config(None, [])
    assert estimate_cli.preference_pairs(config, 500) == (500, 0)
    with pytest.raises(ConfigError, match="--pairs must be at least 1, got 0"):
        estimate_cli.preference_pairs(config, 0)


def test_an_episode_config_is_estimated_at_its_whole_trajectory(tiny_model, capsys):
    tools = str(Path(DEMO).parent / "demo_tools.yaml")  # env.max_total_tokens 96, sampling.max_new_tokens 40
    report = run_json(capsys, tools, f"model.path={tiny_model}", "--gpu", "cpu")
    single = run_json(capsys, tools, f"model.path={tiny_model}", "env=null", "--gpu", "cpu")
    assert (report["workload"]["response_tokens"], single["workload"]["response_tokens"]) == (96, 40)
    memory, single_memory = report["configured"]["memory_gib"], single["configured"]["memory_gib"]
    assert memory["training"]["activations"] > single_memory["training"]["activations"]
