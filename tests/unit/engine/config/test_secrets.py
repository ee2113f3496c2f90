"""Secret values in config trees (rlflow.engine.config.secrets): which keys are secret, redacting and
merging them back, and the forms a secret may be shown in."""

from rlflow.engine.config.schema import Config
from rlflow.engine.config.secrets import (
    REDACTED,
    diff_keys,
    flatten,
    is_secret_path,
    merge_trees,
    redact,
    redact_override,
    secret_strings,
    shown_url,
    split_secrets,
)


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
    b = Config.model_validate({"rl": {"steps": 99}}).model_dump(mode="json")
    assert diff_keys(a, b) == ["rl.steps"]


def test_which_key_paths_are_secret():
    assert is_secret_path(["run", "storage_options", "key"])  # everything under a secret key
    assert is_secret_path(["hf_token"]) and is_secret_path(["alerts", "webhook_url"])
    assert is_secret_path(["x", "API_KEY"])  # case does not matter
    assert not is_secret_path(["sampling", "max_new_tokens"])  # "token" must be the whole last part
    assert not is_secret_path(["ppo", "steps"])


def test_flatten_stops_at_secret_sections_and_empty_secrets_stay_public():
    tree = {"a": {"b": 1, "c": [1, 2]}, "storage_options": {"key": "k"}, "hf_token": ""}
    assert flatten(tree) == {"a.b": 1, "a.c": [1, 2], "storage_options": {"key": "k"}, "hf_token": ""}
    public, secret = split_secrets(tree)
    assert public == {"a": {"b": 1, "c": [1, 2]}, "storage_options": REDACTED, "hf_token": ""}
    assert secret == {"storage_options": {"key": "k"}}  # an empty token holds nothing to hide


def test_overrides_and_urls_are_shown_without_their_secrets():
    assert redact_override("run.storage_options.key=AKIA1234") == "run.storage_options.key=***"
    assert redact_override("rl.steps=3") == "rl.steps=3"
    assert redact_override("hf_token") == "hf_token"  # no value to hide
    assert shown_url("https://user:tok@mlflow.example/api?token=x") == "https://***@mlflow.example/api"
    assert shown_url("http://host:5000/p?q=1") == "http://host:5000/p"
    assert shown_url("sqlite:////abs/mlflow.db") == "sqlite:////abs/mlflow.db"  # kept as given


def test_secret_strings_are_every_leaf_of_four_or_more_characters_longest_first():
    tree = {"a": "abcd", "b": ["longer-secret", "xyz"], "c": None, "d": {"e": 12345}}
    assert secret_strings(tree) == ["longer-secret", "12345", "abcd"]
    assert secret_strings(None) == []
