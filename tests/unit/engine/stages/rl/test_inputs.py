"""What the RL stage reads: PPO's critic section only for PPO, the hacking detector only when on
(with the checkpoint cadence its rollback depends on), the prompt files and not SFT's."""

from conftest import small_config_tree
from helpers.stage_ctx import model
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.rl.inputs import RLUpstream, inputs_from

SFT = model("/sft")
UPSTREAM = RLUpstream(policy=SFT, reference=SFT, sft=SFT)


def inputs(small_assets, tmp_path, **sections):
    return inputs_from(build_config(small_config_tree(small_assets, tmp_path, **sections), "t"), UPSTREAM)


def test_ppo_keys_are_read_for_ppo_only(small_assets, tmp_path):
    ppo = inputs(small_assets, tmp_path, ppo={"lam": 0.9})
    assert ppo.ppo is not None and ppo.ppo.lam == 0.9 and ppo.rl.steps == 3
    grpo = inputs(small_assets, tmp_path, algorithm={"name": "grpo"}, rollout={"n": 2}, ppo={"lam": 0.9})
    assert grpo.ppo is None  # GRPO has no critic and no GAE: ppo.* is not one of its inputs


def test_the_hacking_detector_and_its_rollback_cadence_are_inputs_only_when_on(small_assets, tmp_path):
    off = inputs(small_assets, tmp_path)
    assert off.hacking is None and off.rollback_every_steps is None
    judge = {"name": "j", "type": "length", "weight": 0, "kwargs": {"target": 5}}
    watched = inputs(small_assets, tmp_path, hacking={"enabled": True, "window": 4},
                     reward={"sources": [{"name": "rm", "type": "model"}, judge], "judge": "j"})
    assert watched.hacking.window == 4 and watched.rollback_every_steps == 2  # checkpoint.every_steps


def test_the_data_it_reads_are_its_prompts_and_its_evaluations(small_assets, tmp_path):
    read = inputs(small_assets, tmp_path)
    assert set(type(read.data).model_fields) == {
        "prompts", "eval_prompts", "max_prompt_tokens", "prompt_overflow", "chat_template", "storage_options"
    }
    assert read.data.prompts.endswith("prompts.jsonl") and read.checkpoint.keep_best is None
