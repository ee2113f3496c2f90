"""Naming an environment class in the config: each mistake is caught before anything runs, with a
message naming the reference and what is wrong."""

import pytest

from rlflow.engine.envs.base import EnvStep, Environment, build_environment, environment_class
from rlflow.engine.envs.tool_env import ToolEnv


class NoStep:
    def reset(self, row):
        return []


class StepTakesTwo:
    def reset(self, row):
        return []

    def step(self, text, other):
        return EnvStep(done=True)


class Fine:
    def __init__(self, turns: int = 1):
        self.turns = turns

    def reset(self, row, *, seed=None):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message):
        return EnvStep(done=True, reward=1.0)


def test_a_well_formed_class_is_built_with_its_kwargs():
    env = build_environment(f"{__name__}:Fine", {"turns": 3})
    assert isinstance(env, Environment) and env.turns == 3
    assert environment_class("rlflow.engine.envs.tool_env:ToolEnv") is ToolEnv


@pytest.mark.parametrize(("ref", "kwargs", "message"), [
    ("no_such_module_xyz:Env", {}, "env.fn 'no_such_module_xyz:Env': cannot import 'no_such_module_xyz'"),
    (f"{__name__}:Missing", {}, f"env.fn '{__name__}:Missing': {__name__} has no class 'Missing'"),
    (f"{__name__}:EnvStep", {}, "EnvStep has no method reset\\(row\\)"),
    (f"{__name__}:NoStep", {}, "NoStep has no method step\\(assistant_message\\)"),
    (f"{__name__}:StepTakesTwo", {}, "StepTakesTwo.step must take one argument \\(assistant_message\\), "
                                     "it takes \\(text, other\\)"),
    (f"{__name__}:Fine", {"turn": 3}, "env.kwargs do not fit .*Fine: got an unexpected keyword argument 'turn'"),
])
def test_each_mistake_is_named(ref, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_environment(ref, kwargs)
