"""A run's plan without a model: the stages of each round by the flow's rules, each one's bound
and prefix, its progress read from its checkpoint store, and the printed table."""

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.flows.plan import format_plan, plan_stages, with_progress


def config(small_assets, root, **sections):
    return build_config(small_config_tree(small_assets, root, **sections), "t")


def test_sft_runs_in_its_rounds_and_labels_from_the_online_round(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 2, "name": "p"}, ppo={"steps": 5}, kl={"stop_above": 0.5})
    planned = plan_stages(cfg)
    assert [(p.round_index, p.stage) for p in planned] == [
        (0, "sft"), (0, "rm"), (0, "ppo"), (0, "eval"), (1, "label"), (1, "rm"), (1, "ppo"), (1, "eval"),
    ]  # fmt: skip
    ppo = planned[2]
    assert ppo.steps == "5 steps x 16 prompts (ppo); stops at KL 0.5"
    assert ppo.prefix == stage_prefix(str(tmp_path), "p", 0, "ppo")
    assert planned[4].steps == "32 prompts, 2 answers each" and planned[3].steps == "32 prompts"


def test_dpo_rounds_have_no_reward_model_or_rl_stage(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 1}, algorithm={"name": "dpo"})
    stages = [p.stage for p in plan_stages(cfg)]
    assert stages == ["sft", "dpo", "eval"]


def test_progress_is_read_from_each_stores_final_marker_or_last_commit(small_assets, tmp_path):
    cfg = config(small_assets, tmp_path, run={"rounds": 1, "name": "q"})
    planned = plan_stages(cfg)
    sft = CheckpointStore(planned[0].prefix)
    with sft.writer(40) as w:
        w.write_bytes("x", b"x")
    sft.mark_final(40)
    with CheckpointStore(planned[1].prefix).writer(3) as w:
        w.write_bytes("x", b"x")
    states = [p.state for p in with_progress(planned, {})]
    assert states == ["done at step 40", "at step 3 (committed)", "not started", "not started"]
    text = format_plan(with_progress(planned, {}))
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("  round 0  sft  ") and lines[0].endswith("[done at step 40]")
    assert f"-> {planned[2].prefix}  [not started]" in lines[2]
    assert len({line.index("->") for line in lines}) == 1  # the bounds column is padded to one width
