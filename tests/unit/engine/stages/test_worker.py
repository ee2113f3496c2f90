"""A stage call goes to every rank as a spec file and comes back typed; the worker turns it into
the stage's context and inputs."""

import json

import pytest

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.breaker import StageOverrides
from rlflow.engine.stages.rl.stage import PPOInputs
from rlflow.engine.stages.worker import StageCall, make_context, run_stage_call, write_spec
from rlflow.engine.telemetry.metrics import NullSink


def _ppo_call(root) -> StageCall:
    paths = PPOInputs(f"{root}/sft", f"{root}/sft", f"{root}/sft", f"{root}/rm", (0.25, 2.0), f"{root}/rm")
    return StageCall(
        stage="ppo",
        store_url=f"{root}/ppo",
        round_index=1,
        identity="id",
        identity_tree={"config": {"ppo": {"steps": 3}}},
        ppo_inputs=paths,
        rollout_devices="1",
        overrides=StageOverrides(max_kl=0.5, kl_coef=0.1, from_step=4),
    )


def test_the_spec_file_round_trips_the_call_with_its_types(tmp_path):
    call = _ppo_call(tmp_path)
    write_spec(str(tmp_path / "spec.json"), {"run": {"name": "t"}}, call, str(tmp_path / "outcome.json"))
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["config"] == {"run": {"name": "t"}} and spec["outcome_path"] == str(tmp_path / "outcome.json")
    back = StageCall.model_validate(spec["call"])
    assert back == call
    assert back.ppo_inputs.score_norm == (0.25, 2.0) and back.overrides.kl_coef == 0.1  # a tuple, a dataclass


def test_a_call_keeps_its_default_inputs_through_json(tmp_path):
    call = StageCall(stage="rm", store_url=str(tmp_path), round_index=0, identity="i", identity_tree={})
    back = StageCall.model_validate_json(call.model_dump_json())
    assert back == call and back.ppo_inputs is None and back.extra_preferences == () and back.overrides == StageOverrides()


def test_the_context_takes_the_configs_checkpoint_and_guard_settings(small_assets, tmp_path):
    tree = small_config_tree(small_assets, tmp_path, checkpoint={"every_steps": 3, "keep_last": 4})
    tree["stage"] = {"ppo": {"hang_timeout_s": 77}}
    config = build_config(tree, "t")
    ctx = make_context(config, _ppo_call(tmp_path), NullSink())
    assert (ctx.stage, ctx.round_index, ctx.every_steps, ctx.keep_last) == ("ppo", 1, 3, 4)
    assert ctx.limits.hang_timeout_s == 77 and ctx.store.url.endswith("/ppo")


def test_an_unknown_stage_lists_the_training_stages(small_assets, tmp_path):
    config = build_config(small_config_tree(small_assets, tmp_path), "t")
    call = StageCall(stage="eval", store_url=str(tmp_path / "e"), round_index=0, identity="i", identity_tree={})
    with pytest.raises(ValueError, match="unknown training stage 'eval'; valid: sft, rm, ppo, dpo"):
        run_stage_call(make_context(config, call, NullSink()), config, call)
