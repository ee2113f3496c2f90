"""The hacking section and the declared valid rule (reward.valid): what they name must be reward
sources (a judge of weight 0, a valid rule that is no reward model), the detector must have
something to watch, a checkpoint must precede every window, and DPO has no RL steps to watch."""

import pytest

from rlflow.engine.config.hacking import HackingConfig
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import ConfigError

VALID = {"name": "valid", "type": "format", "weight": 0, "kwargs": {"kind": "nonempty"}}
JUDGE = {"name": "judge", "type": "length", "weight": 0, "kwargs": {"target": 10}}
SOURCES = {"sources": [{"name": "rm", "type": "model"}, VALID, JUDGE]}


def config(valid="valid", judge=None, **hacking):
    reward = SOURCES | {"valid": valid, "judge": judge}
    return build_config({"reward": reward, "checkpoint": {"every_steps": 5}, "hacking": hacking}, "t")


def test_a_detector_on_a_valid_rule_and_a_judge_is_accepted_and_off_by_default():
    assert build_config({}, "t").hacking == HackingConfig() and HackingConfig().enabled is False
    h = config(enabled=True, judge="judge").hacking
    assert (h.window, h.max_valid_drop, h.min_judge_drop, h.max_spread_ratio) == (5, 0.1, 0.0, None)


def test_what_it_names_must_be_reward_sources_and_the_judge_must_stay_out_of_the_reward():
    listed = r"reward.valid='format' is not a reward source; .*\['judge', 'rm', 'valid'\]"
    with pytest.raises(ConfigError, match=listed):
        config(valid="format")
    with pytest.raises(ConfigError, match="reward.valid='rm' is a reward model; a valid rule is a rule or a function"):
        config(valid="rm")
    with pytest.raises(ConfigError, match=r"reward.judge='jury' is not a reward source"):
        config(judge="jury")
    weighted = {"sources": [{"name": "rm", "type": "model"}, JUDGE | {"weight": 0.5}]}
    with pytest.raises(ConfigError, match="reward.judge='judge' has weight 0.5: .* give it weight: 0"):
        build_config({"reward": weighted | {"judge": "judge"}}, "t")
    own = {"sources": [{"name": "rm", "type": "model"}, {"name": "rm2", "type": "model", "weight": 0}]}
    with pytest.raises(ConfigError, match="reward.judge='rm2' is the round's own reward model, the proxy it must"):
        build_config({"reward": own | {"judge": "rm2"}}, "t")
    second = {"name": "rm2", "type": "model", "weight": 0, "path": "elsewhere/rm"}
    two = {"sources": [{"name": "rm", "type": "model"}, second], "judge": "rm2"}
    assert build_config({"reward": two}, "t").reward.judge == "rm2"
    with pytest.raises(ConfigError, match="'hacking.judge' moved to 'reward.judge'"):
        build_config({"hacking": {"judge": "judge"}}, "t")


def test_it_needs_something_to_watch_and_a_checkpoint_before_every_window():
    with pytest.raises(ConfigError, match="hacking.enabled has nothing to watch"):
        config(valid=None, enabled=True)
    with pytest.raises(ConfigError, match="hacking.enabled has nothing to watch"):
        config(enabled=True, max_valid_drop=None)
    with pytest.raises(ConfigError, match="hacking.enabled has nothing to watch"):
        config(valid=None, enabled=True, max_spread_ratio=2.0)  # a spread needs rm.ensemble >= 2
    spread = {"reward": SOURCES, "rm": {"ensemble": 4}, "checkpoint": {"every_steps": 5}}
    assert build_config(spread | {"hacking": {"enabled": True, "max_spread_ratio": 2.0}}, "t").hacking.enabled
    with pytest.raises(ConfigError, match=r"hacking.window=3 is shorter than checkpoint.every_steps=5: .* at most 3"):
        config(enabled=True, window=3)
    dpo = {"reward": SOURCES | {"valid": "valid"}, "checkpoint": {"every_steps": 5}, "algorithm": {"name": "dpo"}}
    with pytest.raises(ConfigError, match="algorithm.name=dpo samples none"):
        build_config(dpo | {"hacking": {"enabled": True}}, "t")
