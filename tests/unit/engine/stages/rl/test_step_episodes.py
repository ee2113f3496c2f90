"""The RL stage with an `env`: GRPO and PPO runs whose prompts are multi-turn episodes, on a tiny Llama
with the demo's chat tokenizer. Episodes of known lengths (helpers.envs:ScriptedEnv, one row's
`turns` column each) show in env/* every step and in eval/env/* at the end; the model's tokens carry
the loss and the weights move."""

import pytest
import torch
from safetensors.torch import load_file

from conftest import RecordingSink, rl_inputs
from helpers.chat_model import write_chat_model
from helpers.stage_ctx import make_ctx
from helpers.stage_ctx import run as run_stage
from rlflow.engine.config.schema import build_config

TURNS = [1, 2, 3, 2]  # mean 2: one tool call per episode on average


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    rows = [{"prompt": f"what is {i} plus 30", "turns": t} for i, t in enumerate(TURNS)]
    return write_chat_model(tmp_path_factory.mktemp("chat"), rows)


def train(chat_run, tmp_path, algorithm: str):
    model = str(chat_run / "model")
    tree = {
        "run": {"name": "t", "root": str(tmp_path), "rounds": 1},
        "model": {"path": model},
        "data": {"prompts": str(chat_run / "prompts.jsonl"), "eval_prompts": str(chat_run / "eval_prompts.jsonl"),
                 "chat_template": "auto"},
        "algorithm": {"name": algorithm},
        "rollout": {"n": 2},
        "rl": {"steps": 2, "rollout_batch": 4, "mini_batch": 4, "epochs": 1, "actor_lr": 1e-3},
        "ppo": {"critic_init": "policy"},
        "gold": {"fn": "helpers.reward_fns:zero"},
        "kl": {"stop_above": None},
        "reward": {"sources": [{"name": "length", "type": "function", "fn": "helpers.reward_fns:scaled_length",
                                "kwargs": {"scale": 0.1}}]},
        "env": {"fn": "helpers.envs:ScriptedEnv", "max_turns": 3, "max_total_tokens": 96},
        "sampling": {"max_new_tokens": 6},
        "eval": {"every_steps": 100, "num_prompts": 4, "batch_size": 4, "num_logged_samples": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
    }
    cfg = build_config(tree, "t")
    sink = RecordingSink()
    critic = model if algorithm == "ppo" else None
    outcome = run_stage(make_ctx(tmp_path, "rl", sink=sink, every=2), rl_inputs(cfg, model, critic=critic))
    return outcome, sink


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_multi_turn_run_trains_on_episodes_of_the_lengths_the_env_gives(chat_run, tmp_path, algorithm):
    outcome, sink = train(chat_run, tmp_path, algorithm)
    assert outcome.metrics["rl/steps"] == 2
    assert [v for _, v in sink.series("env/turns")] == [2.0, 2.0]  # every prompt twice a step
    assert [v for _, v in sink.series("env/tool_calls")] == [1.0, 1.0]
    assert [v for _, v in sink.series("env/truncated")] == [0.0, 0.0]
    assert all(v > 10 for _, v in sink.series("env/observation_tokens"))  # ~15 ids per tool message
    assert [v for _, v in sink.series("eval/env/turns")] == [2.0]  # the final evaluation's episodes
    assert [v for _, v in sink.series("eval/env/tool_calls")] == [1.0]
    # ScriptedEnv's calls are well formed; the one-turn episode made none, and the gold function scores 0
    assert [v for _, v in sink.series("eval/env/well_formed_call_share")] == [0.75]
    assert [v for _, v in sink.series("eval/env/no_call_share")] == [0.25]
    assert [v for _, v in sink.series("eval/env/gold_without_calls")] == [0.0]
    samples = sink.tables["eval_samples.json"]
    assert samples[0]["transcript"].startswith("<|im_start|>user\nwhat is 0 plus 30<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>tool\ntool says 17<|im_end|>" in samples[1]["transcript"]
    start = load_file(str(chat_run / "model" / "model.safetensors"))
    trained = load_file(f"{outcome.checkpoint_uri}/model/model.safetensors")
    moved = max(float((trained[k] - start[k]).abs().max()) for k in start)
    assert 0 < moved < 1 and all(torch.isfinite(t).all() for t in trained.values())
    if algorithm == "ppo":
        assert all(torch.isfinite(torch.tensor(v)) for _, v in sink.series("critic/vf_loss"))
