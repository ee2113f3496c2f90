"""`rlflow promote` on a run laid out as the flow leaves it (config.yaml, summary.json with each
round's gate table, each round's policy registered in a sqlite MLflow store): what it refuses, and
what a manual promotion records in the registry, the run's folder and summary.json."""

import argparse
import getpass
import json
import os
import socket

import pytest
import yaml

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.flows.cli.main import main
from rlflow.flows.cli.promote import command_promote
from rlflow.flows.promotion import OVERRIDES_FILE, read_overrides
from rlflow.tasks.tracking import CHAMPION_ALIAS, RunTracker, record_promotion, register_policy

RUN = "nightly"
FAILED = {"metric": "valid_drop", "value": 0.23, "min": None, "max": 0.1, "passed": False, "reason": "0.23 > max 0.1"}
PASSED = {"metric": "length_ratio", "value": 1.2, "min": 0.5, "max": 2.0, "passed": True, "reason": "1.2 within bounds"}


def decided(r, decision, champion):
    gates = [FAILED if decision == "rejected" else PASSED, PASSED]
    promotion = {"decision": decision, "champion_version": champion, "gates": gates}
    return {"round": r, "gold_score_before": 0.1, "gold_score_after": 0.3, "kl": 0.4, "promotion": promotion}


@pytest.fixture
def run(small_assets, tmp_path, monkeypatch):
    """(root, config, client) of run `nightly`: round 0 promoted (version 1, the champion), round 1
    rejected on valid_drop (version 2)."""
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    root = tmp_path / "runs"
    tree = small_config_tree(
        small_assets,
        root,
        run={"name": RUN, "rounds": 2},
        promotion={"enabled": True},
        tracking={"uri": f"sqlite:///{tmp_path}/m.db"},
    )
    (root / RUN).mkdir(parents=True)
    (root / RUN / "config.yaml").write_text(yaml.safe_dump(tree))
    rows = [decided(0, "promoted", "1"), decided(1, "rejected", "1")]
    (root / RUN / "summary.json").write_text(json.dumps({"run": RUN, "rounds": rows}))
    cfg = build_config(tree, "t")
    tracker = RunTracker(cfg.tracking.uri, cfg.tracking.experiment)
    run_id = tracker.parent_run(RUN, {"run": {"name": RUN}})
    for r in (0, 1):
        tags = {"rlflow.checkpoint_uri": f"{root}/r{r}", "rlflow.manifest_sha256": f"m{r}"}
        register_policy(tracker.client, RUN, r, run_id, tags)
    record_promotion(tracker.client, RUN, "2", {"valid_drop": "0.23 > max 0.1"}, None)
    tracker.client.set_registered_model_alias(f"{RUN}-policy", CHAMPION_ALIAS, "1")
    return root, cfg, tracker.client


def promote(root, round_index, reason="reviewed the invalid answers: near misses"):
    """`rlflow promote` as the CLI runs it: the exit code (errors print one line to stderr)."""
    return main(["promote", RUN, "--round", str(round_index), "--reason", reason, "--root", str(root)])


def test_a_manual_promotion_moves_the_alias_and_records_who_and_why(run, capsys):
    root, cfg, client = run
    assert promote(root, 1) == 0
    who = f"{getpass.getuser()}: reviewed the invalid answers: near misses"
    assert str(client.get_registered_model(f"{RUN}-policy").aliases[CHAMPION_ALIAS]) == "2"
    tags = client.get_model_version(f"{RUN}-policy", "2").tags
    assert tags["rlflow.promotion"] == "promoted" and tags["rlflow.promotion.override"] == who
    assert tags["rlflow.rejected.valid_drop"] == "0.23 > max 0.1"  # what the gates said stays on record
    assert read_overrides(cfg) == {1: who}
    assert json.loads((root / RUN / OVERRIDES_FILE).read_text())["rounds"]["1"]["at"]
    row = json.loads((root / RUN / "summary.json").read_text())["rounds"][1]["promotion"]
    assert (row["decision"], row["champion_version"], row["override"]) == ("promoted", "2", who)
    assert [g["passed"] for g in row["gates"]] == [False, True]
    out = capsys.readouterr().out
    assert "### Round 1: promoted by hand" in out and "version 2 of 'nightly-policy' is the champion" in out
    again = argparse.Namespace(run=RUN, round=1, reason="twice", root=str(root))  # the handler itself
    assert command_promote(again) == 0 and "already promoted (version 2)" in capsys.readouterr().out
    assert read_overrides(cfg) == {1: who}  # not recorded twice


def test_it_refuses_what_it_cannot_promote_and_changes_nothing(run, capsys):
    root, cfg, client = run

    def refused(round_index, reason="r"):
        assert promote(root, round_index, reason) == 2
        return capsys.readouterr().err

    assert "round 0 of run 'nightly' is not its last round (1)" in refused(0)
    assert "round 2 of run 'nightly' has no promotion decision yet (decided: [0, 1])" in refused(2)
    assert "--reason must say why" in refused(1, reason="  ")
    (root / RUN / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "x"}))
    assert "already being run by pid" in refused(1)
    (root / RUN / ".lock").unlink()
    assert str(client.get_registered_model(f"{RUN}-policy").aliases[CHAMPION_ALIAS]) == "1"
    assert not (root / RUN / OVERRIDES_FILE).exists() and read_overrides(cfg) == {}
    off = yaml.safe_load((root / RUN / "config.yaml").read_text()) | {"promotion": {"enabled": False}}
    (root / RUN / "config.yaml").write_text(yaml.safe_dump(off))
    assert "promotion.enabled=false" in refused(1)
