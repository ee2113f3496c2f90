"""The operator's side of a paused stage, without a flow run: the pause form's validation, the
CLI call as it is shown (secrets redacted), and the exact command that continues the run."""

import json

import pytest

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.breaker import BREACH_KL
from rlflow.engine.stages.context import Breach
from rlflow.flows.breach import COMMAND_ENV, BreachDecision, continue_command, shown_command


def test_the_form_refuses_a_rollback_to_an_uncommitted_step_and_a_non_finite_coefficient():
    assert BreachDecision(action="rollback", rollback_step=4).problem([2, 4]) is None
    assert BreachDecision(action="rollback", rollback_step=3).problem([2, 4]) == (
        "rollback_step=3 is not a committed step (committed: [2, 4])"
    )
    assert BreachDecision(kl_coef=float("inf")).problem([]) == "kl_coef=inf is not a finite number"
    assert BreachDecision().problem([]) is None  # continue, keeping the limits


def test_the_shown_command_hides_secret_override_values():
    shown = json.loads(shown_command("c.yaml", ["rl.steps=3", "run.storage_options.secret=abc123"]))
    assert shown["config"] == "c.yaml"
    assert shown["overrides"][0] == "rl.steps=3"
    assert "abc123" not in json.dumps(shown) and shown["overrides"][1].startswith("run.storage_options.secret=")


def test_continuing_after_a_kl_breach_suggests_room_above_the_kl_seen(small_assets, tmp_path, monkeypatch):
    config = build_config(small_config_tree(small_assets, tmp_path, run={"name": "r1"}), "t")
    monkeypatch.setenv(COMMAND_ENV, shown_command("my config.yaml", ["rl.steps=9", "kl.pause_above=0.1"]))
    breach = Breach(reason=BREACH_KL, step=4, metrics={"safety/max_kl": 0.1, "actor/kl": 0.35}, message="kl")
    # the old pause_above is replaced: 2 x the larger of the limit (0.1) and the KL seen (0.35)
    assert continue_command(config, breach) == "rlflow run 'my config.yaml' rl.steps=9 run.name=r1 kl.pause_above=0.7"


def test_continuing_asks_again_for_secret_values_it_never_kept(small_assets, tmp_path, monkeypatch):
    config = build_config(small_config_tree(small_assets, tmp_path, run={"name": "r2"}), "t")
    monkeypatch.setenv(COMMAND_ENV, shown_command("c.yaml", ["run.storage_options.secret=abc123"]))
    breach = Breach(reason="reward", step=2, metrics={}, message="reward")
    command = continue_command(config, breach)
    assert command == "rlflow run c.yaml run.name=r2 (and your values of run.storage_options.secret again)"
    monkeypatch.delenv(COMMAND_ENV)
    assert continue_command(config, breach) == "rlflow run CONFIG run.name=r2"  # no recorded call


@pytest.mark.parametrize("bad", [{"max_kl": 0}, {"kl_coef": -1}, {"rollback_step": -1}, {"action": "pause"}])
def test_the_form_rejects_out_of_range_fields(bad):
    with pytest.raises(ValueError):
        BreachDecision(**bad)
