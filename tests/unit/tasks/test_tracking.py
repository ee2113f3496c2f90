"""RunTracker against a real sqlite MLflow store (no mocks).

One db per module (creating the schema costs ~2 s); each test uses its own experiment.
"""

import json
import pickle
from pathlib import Path

import pytest

from rlflow.tasks.tracking import RunTracker, resolve_tracking_uri

SECRET = "AKIAEXAMPLESECRET123"
TREE = {
    "run": {"name": "demo", "root": "runs", "storage_options": {"key": SECRET, "secret": "s3cr3t"}},
    "model": {"path": "demo_assets/tiny-model", "dtype": "float32"},
    "sft": {"rounds": [0, 1], "lr": 0.002},
    "label": {"labeller": {"fn": "m:f", "kwargs": {"noise": 0.1}}},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlflow")
    return directory, f"sqlite:///{directory}/mlflow.db"


@pytest.fixture
def tracker(store, request, monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return RunTracker(store[1], f"exp_{request.node.name}")


def _artifact(tracker, run_id, name) -> str:
    return Path(tracker.client.download_artifacts(run_id, name)).read_text()


def test_resolve_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri("http://mlflow:5000", str(tmp_path)) == "http://mlflow:5000"
    root = tmp_path / "a" / "b"
    assert resolve_tracking_uri(None, str(root)) == f"sqlite:///{root}/mlflow.db"
    assert root.is_dir()
    assert resolve_tracking_uri(None, f"file://{root}") == f"sqlite:///{root}/mlflow.db"
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri(None, "s3://bucket/x") == f"sqlite:///{tmp_path / 'runs'}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////env/mlflow.db")
    assert resolve_tracking_uri(None, str(root)) == "sqlite:////env/mlflow.db"
    assert resolve_tracking_uri("x://configured", str(root)) == "x://configured"


def test_parent_created_once_and_reattached(tracker, store):
    first = tracker.parent_run("demo", TREE)
    tracker.finish(first, "KILLED")
    again = RunTracker(tracker.tracking_uri, tracker.experiment_name)
    assert again.parent_run("demo", TREE) == first
    run = tracker.client.get_run(first)
    assert run.info.status == "RUNNING"
    assert run.info.run_name == "demo"
    assert run.data.tags["rlflow.kind"] == "parent" and run.data.tags["rlflow.run_name"] == "demo"
    assert tracker.parent_run("other", TREE) != first
    # Artifacts live next to the db, not in ./mlruns of the working directory.
    assert run.info.artifact_uri.startswith((store[0] / "mlartifacts").as_uri())


def test_params_flattened_and_redacted(tracker):
    run_id = tracker.parent_run("demo", TREE)
    params = tracker.client.get_run(run_id).data.params
    assert params["model.path"] == "demo_assets/tiny-model"
    assert params["sft.lr"] == "0.002" and params["sft.rounds"] == "[0, 1]"
    assert params["label.labeller.kwargs.noise"] == "0.1"
    assert params["run.storage_options"] == "***"
    assert not any(SECRET in k or SECRET in v or "s3cr3t" in v for k, v in params.items())
    text = _artifact(tracker, run_id, "config.yaml")
    assert SECRET not in text and "s3cr3t" not in text and "tiny-model" in text
    assert "***" in text


def test_reattach_adds_only_new_params(tracker):
    run_id = tracker.parent_run("demo", TREE)
    changed = {**TREE, "sft": {"rounds": [0, 1], "lr": 0.5}, "extra": {"k": 1}}
    assert tracker.parent_run("demo", changed) == run_id  # changed param must not raise
    params = tracker.client.get_run(run_id).data.params
    assert params["sft.lr"] == "0.002" and params["extra.k"] == "1"


def test_many_long_params_are_batched(tracker):
    tree = {"big": {f"p{i}": i for i in range(250)}, "long": {"v": "x" * 7000}}
    run_id = tracker.parent_run("big", tree)
    params = tracker.client.get_run(run_id).data.params
    assert len(params) == 251 and len(params["long.v"]) <= 6000


def test_child_runs_find_or_create(tracker):
    parent = tracker.parent_run("demo", TREE)
    child = tracker.child_run(parent, 0, "rl")
    assert tracker.child_run(parent, 0, "rl") == child
    assert RunTracker(tracker.tracking_uri, tracker.experiment_name).child_run(parent, 0, "rl") == child
    others = {tracker.child_run(parent, 0, "sft"), tracker.child_run(parent, 1, "rl")}
    assert child not in others and len(others) == 2
    run = tracker.client.get_run(child)
    tags = run.data.tags
    assert tags["mlflow.parentRunId"] == parent and tags["rlflow.kind"] == "child"
    assert tags["rlflow.round"] == "0" and tags["rlflow.stage"] == "rl"
    assert run.info.run_name == "round_0/rl" and run.info.status == "RUNNING"
    tracker.finish(child)
    assert tracker.client.get_run(child).info.status == "FINISHED"
    with pytest.raises(ValueError):
        tracker.finish(child, "DONE")


def test_sink_skips_steps_already_logged_after_resume(tracker):
    run_id = tracker.child_run(tracker.parent_run("demo", TREE), 0, "rl")
    sink = tracker.sink(run_id)
    for step in range(1, 6):
        sink.log_metrics({"actor/pg_loss": float(step), "kl": 0.1 * step}, step)
    sink.log_metrics({"actor/pg_loss": 99.0}, 5)  # same process, same step: still once
    # Simulated resume: a new process (fresh tracker and sink) recomputes steps 3..6.
    resumed = pickle.loads(pickle.dumps(RunTracker(tracker.tracking_uri, tracker.experiment_name)))
    new_sink = resumed.sink(run_id)
    for step in range(3, 7):
        new_sink.log_metrics({"actor/pg_loss": 100.0 + step, "kl": 1.0, "eval/new": 2.0}, step)
    history = tracker.client.get_metric_history(run_id, "actor/pg_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]
    assert {m.step: m.value for m in history}[4] == 4.0  # first value wins
    assert sorted(m.step for m in tracker.client.get_metric_history(run_id, "kl")) == [1, 2, 3, 4, 5, 6]
    assert sorted(m.step for m in tracker.client.get_metric_history(run_id, "eval/new")) == [3, 4, 5, 6]


def test_sink_tables_and_text(tracker):
    run_id = tracker.child_run(tracker.parent_run("demo", TREE), 0, "eval")
    sink = pickle.loads(pickle.dumps(tracker.sink(run_id)))
    rows = [{"prompt": "a", "score": 1.5}, {"prompt": "b", "response": "r"}]
    sink.log_table("eval/samples_step_10.json", rows)
    sink.log_table("eval/samples_step_10.json", rows)  # resumed re-log: not appended
    table = json.loads(_artifact(tracker, run_id, "eval/samples_step_10.json"))
    assert table["columns"] == ["prompt", "score", "response"]
    assert table["data"] == [["a", 1.5, None], ["b", None, "r"]]
    sink.log_text("checkpoint.txt", "s3://bucket/run/step_10")
    sink.log_text("checkpoint.txt", "s3://bucket/run/step_20")
    assert _artifact(tracker, run_id, "checkpoint.txt") == "s3://bucket/run/step_20"
    with pytest.raises(ValueError):
        sink.log_table("samples.csv", rows)


def test_set_tags_and_mark_crashed_children(tracker):
    parent = tracker.parent_run("demo", TREE)
    crashed = tracker.child_run(parent, 0, "rm")
    done = tracker.child_run(parent, 0, "sft")
    tracker.finish(done)
    tracker.set_tags(parent, {"rlflow.status": "running", "rlflow.rounds_done": 1})
    assert tracker.client.get_run(parent).data.tags["rlflow.rounds_done"] == "1"
    assert tracker.mark_crashed_children(parent) == [crashed]
    run = tracker.client.get_run(crashed)
    assert run.info.status == "KILLED" and run.data.tags["rlflow.crashed"] == "true"
    assert tracker.client.get_run(done).info.status == "FINISHED"
    assert "rlflow.crashed" not in tracker.client.get_run(done).data.tags
    assert tracker.client.get_run(parent).info.status == "RUNNING"  # the parent is not a child
    assert tracker.mark_crashed_children(parent) == []
    # The resumed stage re-attaches to its child, which runs again.
    assert tracker.child_run(parent, 0, "rm") == crashed
    assert tracker.client.get_run(crashed).info.status == "RUNNING"


def test_a_stage_continued_under_a_changed_config_tags_the_changed_keys(tracker, store, tmp_path, monkeypatch):
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.stages.context import StageOutcome
    from rlflow.tasks import stages
    from rlflow.tasks.stages import StageSpec, stage_task

    tracking = {"uri": store[1], "experiment": tracker.experiment_name}
    tree = {"run": {"name": "t", "root": str(tmp_path)}, "tracking": tracking}
    config = build_config(tree, "test")
    parent = tracker.parent_run("t", config.model_dump(mode="json"))
    spec = StageSpec(stage="eval", round_index=0, identity="x", identity_tree={}, parent_run_id=parent)
    kept = StageOutcome(
        stage="eval",
        round_index=0,
        step=0,
        checkpoint_uri=f"{tmp_path}/step_000000",
        manifest_sha256="ab" * 32,
        metrics={},
        skipped=True,
        changed_keys=("eval.x",),
    )
    monkeypatch.setattr(stages, "call_inputs", lambda config, call: None)  # the stage itself is not run:
    monkeypatch.setattr(stages, "run_stage", lambda ctx, inputs: kept)  # its outcome is given
    result = stage_task.fn(config, spec, StageOutcome(**dict(kept)))  # any record as the upstream
    assert tracker.client.get_run(result.mlflow_run_id).data.tags["rlflow.changed_keys"] == "eval.x"


def test_the_champion_alias_follows_the_flow_decisions_in_a_real_registry(tracker, tmp_path):
    from rlflow.tasks.tracking import CHAMPION_ALIAS, TAG_PROMOTION, point_champion_alias, record_promotion
    from rlflow.tasks.tracking import register_policy

    run_id = tracker.child_run(tracker.parent_run("gated", {}), 0, "rl")
    client, name = tracker.client, "gated-policy"

    def register(r):
        tags = {"rlflow.checkpoint_uri": str(tmp_path / f"r{r}"), "rlflow.manifest_sha256": f"m{r}"}
        return register_policy(client, "gated", r, run_id, tags)

    def tags(version):
        return {k: v for k, v in client.get_model_version(name, version).tags.items() if k.startswith("rlflow.")}

    def champion():
        champion = client.get_registered_model(name).aliases.get(CHAMPION_ALIAS)
        return None if champion is None else str(champion)

    def decide(version, rejected, champion, override=None):  # as flows/promotion.py records a decision
        record_promotion(client, "gated", version, rejected or {}, override)
        point_champion_alias(client, "gated", champion)

    v0, v1 = register(0), register(1)
    decide(v0, None, v0)
    assert champion() == v0 and tags(v0)[TAG_PROMOTION] == "promoted"
    decide(v1, {"valid_drop": "0.18 > max 0.1"}, v0)
    assert champion() == v0  # the rejected version never holds the alias
    assert tags(v1)[TAG_PROMOTION] == "rejected" and tags(v1)["rlflow.rejected.valid_drop"] == "0.18 > max 0.1"
    # A continued run records the same outcomes again: nothing changes.
    before = (tags(v0), tags(v1))
    decide(v0, None, v0)
    decide(v1, {"valid_drop": "0.18 > max 0.1"}, v0)
    assert (tags(v0), tags(v1)) == before and champion() == v0
    # Decided again under other gates: promoted, the stale rejection tag goes, the alias moves.
    decide(v1, None, v1)
    assert champion() == v1 and tags(v1)[TAG_PROMOTION] == "promoted" and "rlflow.rejected.valid_drop" not in tags(v1)
    # A round 0 decided rejected with no champion before it: the alias is removed, not left stale.
    decide(v0, {"length_ratio": "2.5 > max 2"}, None)
    assert champion() is None and tags(v0)[TAG_PROMOTION] == "rejected"
    # Promoted by hand over its failed gate: promoted, who and why recorded, the gate's verdict kept;
    # decided again without the override, the override tag goes.
    decide(v0, {"length_ratio": "2.5 > max 2"}, v0, override="ana: reviewed, longer answers are right")
    assert champion() == v0 and tags(v0)[TAG_PROMOTION] == "promoted"
    assert tags(v0)["rlflow.promotion.override"] == "ana: reviewed, longer answers are right"
    assert tags(v0)["rlflow.rejected.length_ratio"] == "2.5 > max 2"
    decide(v0, {"length_ratio": "2.5 > max 2"}, None)
    assert "rlflow.promotion.override" not in tags(v0) and tags(v0)[TAG_PROMOTION] == "rejected"
