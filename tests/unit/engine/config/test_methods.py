"""The training-method sections (rlflow.engine.config.methods): the algorithm's name, the reward
sources' fields per type, and the reward section's rules, each refusal naming the key and the fix."""

import re

import pytest
from pydantic import ValidationError

from rlflow.engine.config.base import FunctionRef
from rlflow.engine.config.methods import (
    ALGORITHMS,
    AlgorithmConfig,
    DPOConfig,
    RewardConfig,
    RewardSourceConfig,
)


def refused(cls, message: str, **keys) -> None:
    """`cls(**keys)` fails with exactly `message` somewhere in pydantic's error text."""
    with pytest.raises(ValidationError, match=re.escape(message)):
        cls(**keys)


def test_unknown_algorithm_lists_the_valid_ones_and_critic_free_ones_are_known():
    refused(AlgorithmConfig, "unknown algorithm.name 'a2c'; valid: ppo, grpo, rloo, reinforce_pp, dpo", name="a2c")
    free = {name: AlgorithmConfig(name=name).critic_free for name in ALGORITHMS}
    assert free == {"ppo": False, "grpo": True, "rloo": True, "reinforce_pp": True, "dpo": False}


def test_reward_source_names_and_types_are_checked():
    refused(
        RewardSourceConfig,
        "reward source name 'a b' must be letters, digits, '_', '-' or '.'",
        name="a b",
        type="length",
    )
    refused(RewardSourceConfig, "reward source name '' must be", name="", type="length")
    assert RewardSourceConfig(name="fmt-v1.2_x", type="format").name == "fmt-v1.2_x"
    refused(
        RewardSourceConfig,
        "unknown reward source type 'rule'; valid: model, function, keyword, regex, length, format, exact_match, gym",
        name="r", type="rule",
    )  # fmt: skip


def test_each_reward_source_type_takes_only_its_own_fields():
    refused(
        RewardSourceConfig, "reward source 'f' (type function) needs fn: 'module:function'", name="f", type="function"
    )
    refused(RewardSourceConfig, "'m.f' must look like 'package.module:function'", name="f", type="function", fn="m.f")
    refused(
        RewardSourceConfig,
        "reward source 'k': fn is only for type function, not 'keyword'",
        name="k",
        type="keyword",
        fn="m:f",
    )
    refused(
        RewardSourceConfig,
        "reward source 'k': path is only for type model, not 'keyword'",
        name="k",
        type="keyword",
        path="/rm",
    )
    assert RewardSourceConfig(name="f", type="function", fn="m:f", kwargs={"a": 1}).kwargs == {"a": 1}
    assert RewardSourceConfig(name="rm2", type="model", path="/rm").path == "/rm"


def test_a_sources_error_policy_is_its_own_then_skip_for_gym_then_the_sections():
    gym, rule = RewardSourceConfig(name="g", type="gym"), RewardSourceConfig(name="r", type="length")
    assert (gym.error_policy("fail"), rule.error_policy("fail"), rule.error_policy("skip")) == ("skip", "fail", "skip")
    assert RewardSourceConfig(name="g", type="gym", on_error="fail").error_policy("skip") == "fail"


def test_the_reward_section_needs_distinct_sources_and_a_fallback_rule_to_fall_back_to():
    refused(
        RewardConfig, "reward.sources is empty: give at least one source (e.g. {name: rm, type: model})", sources=[]
    )
    twice = [{"name": "a", "type": "length"}, {"name": "a", "type": "format"}]
    refused(RewardConfig, "reward.sources names must be unique, got ['a', 'a']", sources=twice)
    refused(
        RewardConfig, "reward.on_failure=fallback_rule needs reward.fallback_rule.fn (a 'module:function')",
        on_failure="fallback_rule",
    )  # fmt: skip
    rule = FunctionRef(fn="m:score")
    assert RewardConfig(on_failure="fallback_rule", fallback_rule=rule).fallback_rule == rule


def test_the_reward_is_learned_only_with_a_model_source_of_the_rounds_own_stage():
    assert RewardConfig().learned  # the default: the round's reward model
    assert not RewardConfig(sources=[{"name": "rm", "type": "model", "path": "/rm"}]).learned
    assert not RewardConfig(sources=[{"name": "len", "type": "length"}]).learned
    mixed = [{"name": "len", "type": "length"}, {"name": "rm", "type": "model"}]
    assert RewardConfig(sources=mixed).learned


def test_dpo_bounds():
    assert (DPOConfig().beta, DPOConfig().reference) == (0.1, "round_start")
    for keys, field in (
        ({"beta": 0}, "beta"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"reference": "x"}, "reference"),
    ):
        with pytest.raises(ValidationError) as info:
            DPOConfig(**keys)
        assert info.value.errors()[0]["loc"] == (field,)


def test_policy_loss_and_rollout_correction_names_and_cap_are_checked():
    refused(AlgorithmConfig, "unknown algorithm.policy_loss 'grpo'; valid: ppo, gspo, cispo", policy_loss="grpo")
    refused(
        AlgorithmConfig,
        "unknown algorithm.rollout_correction 'is'; valid: none, tis, mis",
        rollout_correction="is",
    )
    refused(AlgorithmConfig, "greater than 1", correction_cap=1.0)
    refused(AlgorithmConfig, "'token' or 'sequence'", correction_level="row")


def test_dapo_keys_are_checked_against_the_rest_of_the_config():
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.errors import ConfigError

    grpo = {"algorithm": {"name": "grpo", "dynamic_sampling": True}, "rollout": {"n": 4}}
    assert build_config(grpo, "t").algorithm.dynamic_sampling_max_tries == 3
    with pytest.raises(ConfigError, match=r"algorithm.dynamic_sampling .* rollout.n >= 2 .* \(got 1\)"):
        build_config({"algorithm": {"dynamic_sampling": True}, "rollout": {"n": 1}}, "t")
    with pytest.raises(ConfigError, match="dynamic_sampling with rollout.mode=server"):
        build_config(grpo | {"rollout": {"n": 4, "mode": "server"}}, "t")
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer=40 .* sampling.max_new_tokens=32.* at most 32"):
        build_config({"reward": {"overlong_buffer": 40}, "sampling": {"max_new_tokens": 32}}, "t")


def test_the_uncertainty_penalty_needs_the_rounds_reward_model_to_be_an_ensemble():
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.errors import ConfigError

    config = build_config({"rm": {"ensemble": 4}, "reward": {"uncertainty_penalty": 0.5}}, "t")
    assert (config.rm.ensemble, config.reward.uncertainty_penalty) == (4, 0.5)
    with pytest.raises(ConfigError, match=r"uncertainty_penalty=0.5 .* but rm.ensemble=1 trains one head; set rm.ens"):
        build_config({"reward": {"uncertainty_penalty": 0.5}}, "t")
    rule_only = {"sources": [{"name": "len", "type": "length", "kwargs": {"target": 3}}], "uncertainty_penalty": 1.0}
    with pytest.raises(ConfigError, match="no reward source is the round's reward model"):
        grpo = {"algorithm": {"name": "grpo"}, "rollout": {"n": 4}}
        build_config({"rm": {"ensemble": 4}, "reward": rule_only} | grpo, "t")
    with pytest.raises(ConfigError, match=r"rm.ensemble"):
        build_config({"rm": {"ensemble": 0}}, "t")
