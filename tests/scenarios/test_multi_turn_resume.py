"""A multi-turn RL stage killed after its tools ran, then started again, ends exactly like an
uninterrupted run, and its tools ran once: the rerun replays their outputs from the stage's
journal (engine/stages/rl/tool_journal.py). The environment (helpers.envs:CountingEnv) answers
with how many calls had been made before, so a tool run again would change the tokens."""

from pathlib import Path

import pytest

from helpers.chat_model import write_chat_model
from helpers.stage_ctx import rl_call
from helpers.stage_worker import final_files, finish_worker, stable, start_worker
from rlflow.engine.faults import KILLED_EXIT_CODE
from rlflow.engine.storage.checkpoint import CheckpointStore


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    rows = [{"prompt": f"what is {i} plus 30"} for i in range(4)]
    return write_chat_model(tmp_path_factory.mktemp("chat-model"), rows)


def tree(chat_model, root, algorithm):
    return {
        "run": {"name": "t", "root": str(root), "rounds": 1, "threads": 1},
        "model": {"path": str(chat_model / "model")},
        "data": {"prompts": str(chat_model / "prompts.jsonl"), "eval_prompts": str(chat_model / "eval_prompts.jsonl"),
                 "chat_template": "auto"},
        "algorithm": {"name": algorithm},
        "rollout": {"n": 2, "generate_batch": 4},  # two chunks a step: two journal entries
        "rl": {"steps": 3, "rollout_batch": 4, "mini_batch": 4, "epochs": 1, "actor_lr": 1e-3, "log_every": 1},
        "ppo": {"critic_init": "policy"},
        "kl": {"stop_above": None},
        "reward": {"sources": [{"name": "length", "type": "function", "fn": "helpers.reward_fns:scaled_length",
                                "kwargs": {"scale": 0.1}}]},
        "env": {"fn": "helpers.envs:CountingEnv", "kwargs": {"log": str(root / "calls.log")}, "max_total_tokens": 64},
        "sampling": {"max_new_tokens": 5},
        "eval": {"every_steps": 100, "num_prompts": 4, "batch_size": 4},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
    }


def call(chat_model, root, algorithm):
    model = str(chat_model / "model")
    return rl_call(root, model, critic=model if algorithm == "ppo" else None)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_killed_multi_turn_step_replays_its_tools_and_ends_like_an_uninterrupted_run(
    algorithm, chat_model, tmp_path_factory, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # the workers import helpers.envs
    ref_root, root = tmp_path_factory.mktemp(f"ref-{algorithm}"), tmp_path_factory.mktemp(f"killed-{algorithm}")
    ref_tree, ref_call = tree(chat_model, ref_root, algorithm), call(chat_model, ref_root, algorithm)
    reference = start_worker(ref_root, ref_tree, ref_call, None)
    logged = []
    # Step 3 is killed after its rollout (its journal written), step 2's checkpoint committed before it.
    for fault in ("batch_received:3", None):
        rc, metrics, err = finish_worker(start_worker(root, tree(chat_model, root, algorithm),
                                                      call(chat_model, root, algorithm), fault))
        assert rc == (KILLED_EXIT_CODE if fault else 0), f"{fault}: exit {rc}\n{err}"
        logged += metrics
        if fault:
            store = CheckpointStore(f"{root}/rl")
            assert store.committed_steps() == [2]
            assert store.inflight_names() == ["tools_step_000003_rank_0.json"]
    rc, ref_metrics, err = finish_worker(reference)
    assert rc == 0, err
    by_step = {step: stable(m) for step, m in ref_metrics}
    for step, metrics in logged:
        assert stable(metrics) == {k: by_step[step][k] for k in stable(metrics)}, f"step {step} differs"
    assert final_files(f"{root}/rl") == final_files(f"{ref_root}/rl")
    ran, ran_once = (root / "calls.log").read_text().splitlines(), (ref_root / "calls.log").read_text().splitlines()
    assert len(ran) == len(ran_once) > 0  # step 3's tools were not run a second time
    assert CheckpointStore(f"{root}/rl").inflight_names() == []  # the finished stage left no journal
