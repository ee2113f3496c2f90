from pathlib import Path

import pytest

from rlflow.engine.config import Config, apply_override, build_config, load_config
from rlflow.engine.secrets import REDACTED, diff_keys, flatten, merge_trees, redact, split_secrets
from rlflow.engine.errors import ConfigError

# Run configs; prices.yaml is `rlflow estimate`'s device and price table (tests/engine/test_estimate.py).
CONFIGS = sorted(p for p in (Path(__file__).parents[2] / "configs").glob("*.yaml") if p.name != "prices.yaml")


def test_configs_folder_is_not_empty():
    assert any(p.name == "demo.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert isinstance(config, Config)
    assert config.run.rounds >= 1


def test_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  steps: 5\n")
    config = load_config(
        path, ["ppo.steps=7", "ppo.kl.target=0.2", "sft.rounds=[0, 2]", "run.name=exp-1", "ppo.stop_kl=null"]
    )
    assert config.ppo.steps == 7
    assert config.ppo.kl.target == pytest.approx(0.2)
    assert config.sft.rounds == [0, 2]
    assert config.run.name == "exp-1"
    assert config.ppo.stop_kl is None


def test_unknown_key_lists_valid_keys_of_that_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  stepz: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "ppo.stepz" in message and str(path) in message
    assert "steps" in message and "rollout_batch" in message and "\n" not in message


def test_unknown_top_level_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pop: {}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'pop' in top level; valid keys: .*checkpoint.*ppo"):
        load_config(path)


def test_wrong_type_names_key_and_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"'ppo.steps': 'many'"):
        load_config(path, ["ppo.steps=many"])


def test_out_of_range_value_names_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  top_p: 1.5\n")
    with pytest.raises(ConfigError, match=r"'ppo.top_p': 1.5 .*less than or equal to 1"):
        load_config(path)


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "x y", ".hidden"])
def test_unsafe_run_name_is_rejected(name):
    with pytest.raises(ConfigError, match="not safe for a path"):
        build_config({"run": {"name": name}}, "test")


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=rf"{path.name}:\d+: not valid YAML"):
        load_config(path)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/c.yaml")


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_override({}, "ppo.steps")


def test_secrets_are_split_out_and_merged_back():
    tree = Config().model_dump(mode="json")
    tree["run"]["storage_options"] = {
        "key": "AKIAXXXX",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://x"},
    }
    public, secret = split_secrets(tree)
    assert public["run"]["storage_options"] == REDACTED
    assert "AKIAXXXX" not in repr(public) and "s3cr3t" not in repr(flatten(redact(tree)))
    assert secret == {"run": {"storage_options": tree["run"]["storage_options"]}}
    assert merge_trees(public, secret) == tree
    assert public["model"]["path"] == tree["model"]["path"]  # non-secrets untouched


def test_diff_keys_names_changed_leaves():
    a = Config().model_dump(mode="json")
    b = Config.model_validate({"ppo": {"steps": 99}}).model_dump(mode="json")
    assert diff_keys(a, b) == ["ppo.steps"]
