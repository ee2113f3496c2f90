import re
from pathlib import Path

import pytest
import yaml

from rlflow.engine.config.moved import MOVED_KEYS
from rlflow.engine.config.schema import Config, apply_override, build_config, load_config
from rlflow.engine.config.secrets import flatten
from rlflow.engine.errors import ConfigError
from rlflow.engine.rewards.user_functions import load_function

# Run configs; prices.yaml is `rlflow estimate`'s device and price table (tests/unit/engine/estimate/test_hardware.py).
CONFIGS = sorted(p for p in (Path(__file__).parents[4] / "configs").glob("*.yaml") if p.name != "prices.yaml")


def test_configs_folder_is_not_empty():
    assert any(p.name == "demo.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_with_every_value_it_sets(path):
    config = load_config(path)
    # Every scalar the file sets is the loaded value (a key moved or shadowed would not be), and
    # every function it names imports.
    loaded = flatten(config.model_dump(mode="json"))
    for key, value in flatten(yaml.safe_load(path.read_text())).items():
        if isinstance(value, (dict, list)) and value and isinstance(next(iter(value)), dict):
            continue  # a list of sections (reward.sources): its items get their defaults filled in
        expected = float(value) if isinstance(loaded[key], float) else value  # YAML reads 5e-5 as a string
        assert loaded[key] == expected, key
    refs = [config.gold.fn, config.label.labeller.fn] + [s.fn for s in config.reward.sources if s.fn]
    assert all(callable(load_function(ref, "fn")) for ref in refs)
    assert Config.model_validate(config.model_dump(mode="json")) == config


def test_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rl:\n  steps: 5\n")
    config = load_config(
        path, ["rl.steps=7", "kl.target=0.2", "sft.rounds=[0, 2]", "run.name=exp-1", "kl.stop_above=null"]
    )
    assert config.rl.steps == 7
    assert config.kl.target == pytest.approx(0.2)
    assert config.sft.rounds == [0, 2]
    assert config.run.name == "exp-1"
    assert config.kl.stop_above is None


def test_unknown_key_lists_valid_keys_of_that_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rl:\n  stepz: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "rl.stepz" in message and str(path) in message
    assert "steps" in message and "rollout_batch" in message and "\n" not in message


def test_unknown_top_level_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pop: {}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'pop' in top level; valid keys: .*checkpoint.*ppo"):
        load_config(path)


def test_wrong_type_names_key_and_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"'rl.steps': 'many'"):
        load_config(path, ["rl.steps=many"])


def test_out_of_range_value_names_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sampling:\n  top_p: 1.5\n")
    with pytest.raises(ConfigError, match=r"'sampling.top_p': 1.5 .*less than or equal to 1"):
        load_config(path)


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "x y", ".hidden"])
def test_unsafe_run_name_is_rejected(name):
    with pytest.raises(ConfigError, match="not safe for a path"):
        build_config({"run": {"name": name}}, "test")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/c.yaml")


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_override({}, "rl.steps")


VALUES = {  # a valid value of each moved key that is not a float
    "ppo.kl.controller": "fixed",
    "ppo.kl.estimator": "k2",
    "algorithm.kl_loss_type": "k2",
    "ppo.reference": "round_start",
    "algorithm.use_kl_loss": True,
    "safety.kl_patience": 5,
    "ppo.kl.horizon": 500,
    "ppo.max_new_tokens": 7,
    "hacking.judge": "j",
    "ppo.steps": 3,
    "ppo.rollout_batch": 96,
    "ppo.mini_batch": 16,
    "ppo.epochs": 3,
    "ppo.log_every": 3,
    "ppo.loss_agg": "seq-mean-token-sum",
    "stage.ppo": {"retries": 2},
}


NEEDS = {"hacking.judge": ["reward.sources=[{name: rm, type: model}, {name: j, type: length, weight: 0}]"]}


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_moved_key_fails_naming_its_new_key(tmp_path, old):
    section, *rest = old.split(".")
    value = VALUES.get(old, 0.5)
    nested = value
    for part in reversed(rest):
        nested = {part: nested}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({section: nested}))
    with pytest.raises(ConfigError, match=rf"c\.yaml:\d+: '{re.escape(old)}' moved to '{re.escape(MOVED_KEYS[old])}'"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"'{re.escape(old)}' moved to '{re.escape(MOVED_KEYS[old])}'"):
        load_config(_empty(tmp_path), [f"{old}={value}"])
    new_section, new_key = MOVED_KEYS[old].split(".")
    needs = NEEDS.get(old, [])
    moved = load_config(_empty(tmp_path), [*needs, f"{MOVED_KEYS[old]}={value}"])
    got = getattr(getattr(moved, new_section), new_key)
    assert (got.model_dump(exclude_none=True) if isinstance(value, dict) else got) == value


def test_the_old_kl_section_as_a_whole_lists_where_each_key_went(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  kl: {}\n")
    with pytest.raises(ConfigError, match=r"section 'ppo.kl' moved: controller -> kl.controller, .*init_coef -> kl.coef"):
        load_config(path)
    path.write_text("ppo:\n  kl: {target: 0.1, init_coef: 0.2}\n")
    with pytest.raises(ConfigError, match=r"'ppo.kl.init_coef' moved to 'kl.coef'"):  # the first, sorted
        load_config(path)


def _empty(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    return path
