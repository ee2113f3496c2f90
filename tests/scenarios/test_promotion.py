"""Promotion gates through the real CLI, a real Prefect server and a real MLflow sqlite store: a
rejected round halts the run (on_reject=fail) with everything recorded; continued with
on_reject=pause, the flow run pauses at each rejected round and an operator's answers (continue,
then promote) decide the next round's start; the champion alias follows the decisions, also when
the process dies between a round's tags and its alias move."""

import json
import os

from mlflow.tracking import MlflowClient

from conftest import small_config_tree
from helpers.pipeline import cli, finish, resume_paused, wait_paused, write_config
from rlflow.engine.faults import FAULT_ENV, FAULT_ONCE_ENV, KILLED_EXIT_CODE

REJECT_ALL = [{"metric": "kl", "min": 1000.0}, {"metric": "length_ratio", "min": 0.01, "max": 100.0}]


def _upstream(root, r, stage):
    """The identities of a finished stage's upstream inputs, as its identity tree recorded them."""
    return json.loads((root / "gated" / f"round_{r}" / stage / "final.json").read_text())["identity_tree"]["upstream"]


def _gate_artifacts(api_url, key):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_a_rejected_round_is_recorded_and_the_next_round_starts_from_the_champion(
    prefect_server, small_assets, tmp_path
):
    root = tmp_path / "runs"
    tree = small_config_tree(
        small_assets,
        root,
        run={"name": "gated", "rounds": 1},
        rl={"steps": 2},
        label={"online_from_round": 1, "prompts_per_round": 16},
        promotion={"enabled": True, "on_reject": "fail", "gates": REJECT_ALL},
    )
    config = write_config(tmp_path / "c.yaml", tree)
    proc = cli(config)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 3, out[-3000:]  # RunHalted: a guard, not bad input
    assert "rejected by the promotion gates (kl:" in out and "promotion.on_reject=continue" in out
    assert "Traceback" not in out.splitlines()[-1]
    row = json.loads((root / "gated" / "summary.json").read_text())["rounds"][0]
    assert row["promotion"]["decision"] == "rejected" and row["promotion"]["champion_version"] is None
    assert [g["passed"] for g in row["promotion"]["gates"]] == [False, True]

    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    version = client.get_model_version("gated-policy", "1")
    assert version.tags["rlflow.promotion"] == "rejected" and "< min 1000" in version.tags["rlflow.rejected.kl"]
    assert "champion" not in client.get_registered_model("gated-policy").aliases
    [artifact] = _gate_artifacts(prefect_server, "promotion-gated-round-0")
    assert "### Round 0: rejected" in artifact.data and "| kl |" in artifact.data

    # Continued with a second round and on_reject=pause. Round 0, decided again from its cached
    # evaluation (the same outcome, no new version), pauses the flow run: answered `continue`,
    # round 1 starts from round 0's start (its SFT policy), its online labels from round 0's answers.
    # Round 1 is rejected and pauses too:
    # answered `promote`, it becomes the champion, recorded as a manual override (the override is
    # the run's: the flow decides the round again, reading it, as every continued run does).
    proc = cli(config, "run.rounds=2", "promotion.on_reject=pause")
    resume_paused(prefect_server, wait_paused(prefect_server, "gated", proc).id, {"action": "continue"}, proc)
    by_hand = {"action": "promote", "operator": "ana", "reason": "checked by hand"}
    resume_paused(prefect_server, wait_paused(prefect_server, "gated", proc).id, by_hand, proc)
    out = finish(proc)
    assert "[round 0 rl] step" not in out and "[round 1 rl] step 2/2" in out
    assert _upstream(root, 1, "rl")["policy"] == _upstream(root, 0, "rl")["policy"]
    # ... while its reward model learns from pairs of the rejected policy's answers, its blind spot
    rejected = json.loads((root / "gated" / "round_0" / "rl" / "final.json").read_text())["manifest_sha256"]
    assert _upstream(root, 1, "label")["policy"] == rejected
    assert "round 1 promoted by hand (ana: checked by hand)" in out
    assert f"final policy: {root / 'gated' / 'round_1' / 'rl'}" in out
    versions = sorted(client.search_model_versions("name = 'gated-policy'"), key=lambda v: int(v.version))
    outcomes = [(v.tags["rlflow.round"], v.tags["rlflow.promotion"]) for v in versions]
    assert outcomes == [("0", "rejected"), ("1", "promoted")]
    assert versions[1].tags["rlflow.promotion.override"] == "ana: checked by hand"
    assert versions[1].tags["rlflow.rejected.kl"].endswith("< min 1000")  # what the gates said stays
    assert client.get_registered_model("gated-policy").aliases == {"champion": 2}
    rows = json.loads((root / "gated" / "summary.json").read_text())["rounds"]
    assert [r["promotion"]["decision"] for r in rows] == ["rejected", "promoted"]
    assert rows[1]["promotion"]["override"] == "ana: checked by hand"
    assert "rejected" in out.split("gold_score_before")[-1]  # the printed table's promotion column

    # Round 0 decided again under a gate it passes, the process killed after its tags, before the
    # alias moves: the tags say promoted, the alias still on round 1's version; the continued run
    # moves it to round 0's (the champion of a 1-round run), and registers nothing twice.
    passing = "promotion.gates=[{metric: kl, max: 1000.0}]"
    env = {k: v for k, v in os.environ.items() if k != FAULT_ONCE_ENV} | {FAULT_ENV: "promotion:alias:0"}
    killed = cli(config, "run.rounds=1", passing, env=env)
    out, _ = killed.communicate(timeout=400)
    assert killed.returncode == KILLED_EXIT_CODE, out[-3000:]
    assert client.get_model_version("gated-policy", "1").tags["rlflow.promotion"] == "promoted"
    assert "rlflow.rejected.kl" not in client.get_model_version("gated-policy", "1").tags
    assert client.get_registered_model("gated-policy").aliases == {"champion": 2}
    finish(cli(config, "run.rounds=1", passing))
    assert client.get_registered_model("gated-policy").aliases == {"champion": 1}  # the sqlite store gives int versions
    assert client.get_model_version("gated-policy", "1").tags["rlflow.promotion"] == "promoted"
    assert len(client.search_model_versions("name = 'gated-policy'")) == 2  # rounds 0 and 1, none twice
    parent = client.search_runs(
        [client.get_experiment_by_name("rlflow").experiment_id], "tags.`rlflow.kind` = 'parent'"
    )[0]
    assert "promotion/round_0.md" in {a.path for a in client.list_artifacts(parent.info.run_id, "promotion")}
    assert "Round 0: promoted" in (root / "gated" / "report.html").read_text()
