"""The `env` section: a buildable environment or a one-line error naming what to change, and the
combinations the multi-turn RL stage does not run refused with the fix."""

import pytest

from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import ConfigError

TOOLS = {"fn": "rlflow.engine.envs.tool_env:ToolEnv", "kwargs": {"tools": ["calculator"]}}
# A verifier's reward and a critic-free estimator: what tool-using runs take.
BASE = {"data": {"chat_template": "auto"}, "reward": {"sources": [{"name": "exact", "type": "exact_match"}]},
        "algorithm": {"name": "grpo"}, "rollout": {"n": 4}}


def test_a_tool_environment_loads_with_its_defaults():
    env = EnvConfig(**TOOLS)
    assert (env.max_turns, env.max_total_tokens, env.tool_workers) == (4, 256, 4)
    assert build_config(BASE | {"env": TOOLS}, "c.yaml").env == env
    assert build_config({}, "c.yaml").env is None  # single-turn unless asked


@pytest.mark.parametrize(("env", "message"), [
    ({**TOOLS, "kwargs": {"tools": ["calculator"], "retries": 2}}, "env.kwargs do not fit .*ToolEnv: got an unexpected"
     " keyword argument 'retries'"),
    ({**TOOLS, "kwargs": {"parser": "qwen"}}, "env rlflow.engine.envs.tool_env:ToolEnv: unknown tool parser 'qwen'"),
    ({"fn": "rlflow.engine.envs.tool_env"}, "must look like 'package.module:Class'"),
    ({**TOOLS, "max_total_tokens": 0}, "env.max_total_tokens"),
])
def test_a_wrong_env_is_one_line_naming_it(env, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_config(BASE | {"env": env}, "c.yaml")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("sections", "message"), [
    ({"algorithm": {"name": "dpo"}}, "algorithm.name=dpo trains on preference pairs, not episodes"),
    ({"rollout": {"mode": "server"}}, "env with rollout.mode=server is not supported yet"),
    ({"engine": {"backend": "deepspeed", "zero_stage": 3}}, "env with engine.zero_stage=3 is not supported yet"),
    ({"rl": {"loss_agg": "seq-mean-token-sum-norm"}}, "rl.loss_agg=seq-mean-token-sum-norm divides by"),
    ({"reward": {"overlong_buffer": 4}}, "reward.overlong_buffer ramps over one response's sampling.max_new_tokens"),
    ({"data": {"chat_template": "none"}}, r"env needs the tokenizer's chat template .*set data.chat_template=auto"),
    ({"run": {"rounds": 2}, "reward": {"sources": [{"name": "rm", "type": "model"}]}},
     r"env with online labels \(label.online_from_round=1\) is not supported yet"),
])
def test_what_episodes_cannot_run_with_is_refused_with_the_fix(sections, message):
    tree = BASE | {"env": TOOLS} | sections
    with pytest.raises(ConfigError, match=message):
        build_config(tree, "c.yaml")
