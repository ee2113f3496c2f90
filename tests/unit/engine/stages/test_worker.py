"""A stage call goes to every rank as a spec file and comes back typed; the worker turns it into
the stage's context and, with the stage's own builder, its inputs."""

import json

import pytest

from conftest import small_config_tree
from helpers.stage_ctx import make_call, model, reward_model
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.context import StageOverrides
from rlflow.engine.stages.rl.inputs import RLInputs, RLUpstream
from rlflow.engine.stages.worker import StageCall, call_inputs, make_context, write_spec
from rlflow.engine.telemetry.metrics import NullSink


def _rl_call(root) -> StageCall:
    sft = model(f"{root}/sft")
    upstream = RLUpstream(policy=sft, reference=sft, sft=sft, reward_model=reward_model(f"{root}/rm", (0.25, 2.0)),
                          critic=model(f"{root}/rm"))
    call = make_call(root, "rl", upstream, rollout_devices="1", overrides=StageOverrides(0.5, 0.1, 4))
    return call.model_copy(update={"round_index": 1})


def test_the_spec_file_round_trips_the_call_with_its_types(tmp_path):
    call = _rl_call(tmp_path)
    write_spec(str(tmp_path / "spec.json"), {"run": {"name": "t"}}, call, str(tmp_path / "outcome.json"))
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["config"] == {"run": {"name": "t"}} and spec["outcome_path"] == str(tmp_path / "outcome.json")
    back = StageCall.model_validate(spec["call"])
    assert back == call and back.overrides.kl_coef == 0.1  # a dataclass
    assert RLUpstream.model_validate(back.upstream).reward_model.score_norm == (0.25, 2.0)  # a tuple


def test_the_worker_builds_the_stage_inputs_with_the_stages_own_builder(small_assets, tmp_path):
    config = build_config(small_config_tree(small_assets, tmp_path, rl={"steps": 5}), "t")
    inputs = call_inputs(config, _rl_call(tmp_path))
    assert isinstance(inputs, RLInputs) and inputs.rl.steps == 5 and inputs.seed == config.run.seed
    assert inputs.upstream.policy.uri == f"{tmp_path}/sft" and inputs.upstream.reward_model.score_norm == (0.25, 2.0)


def test_the_context_takes_the_configs_checkpoint_and_guard_settings(small_assets, tmp_path):
    tree = small_config_tree(small_assets, tmp_path, checkpoint={"every_steps": 3, "keep_last": 4})
    tree["stage"] = {"rl": {"hang_timeout_s": 77}}
    config = build_config(tree, "t")
    ctx = make_context(config, _rl_call(tmp_path), NullSink())
    assert (ctx.stage, ctx.round_index, ctx.every_steps, ctx.keep_last) == ("rl", 1, 3, 4)
    assert ctx.limits.hang_timeout_s == 77 and ctx.store.url.endswith("/rl")
    assert ctx.rollout_devices == "1" and ctx.overrides == StageOverrides(0.5, 0.1, 4)


def test_an_unknown_stage_lists_the_stages(small_assets, tmp_path):
    config = build_config(small_config_tree(small_assets, tmp_path), "t")
    call = _rl_call(tmp_path).model_copy(update={"stage": "ppo"})
    with pytest.raises(ValueError, match="unknown stage 'ppo'; valid: sft, label, rm, rl, dpo, eval"):
        call_inputs(config, call)
