"""The whole flow through the real CLI, a real Prefect server and a real MLflow sqlite store:
the run tree and Prefect's task runs are checked, and a SIGKILLed run continues where it stopped."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from conftest import small_config_tree
from helpers.pipeline import cli, finish, prefect_task_runs, write_config
from rlflow.engine.storage.checkpoint import CheckpointStore


def wait_for(path, proc, timeout=300):
    """Poll until `path` exists (an event the run produces, not a sleep); the run must be alive."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def mlflow_runs(root, uri=None):
    """(client, parent runs, {(round, stage): child run}) of the run tree in a sqlite store."""
    client = MlflowClient(uri or f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("rlflow")
    runs = client.search_runs([experiment.experiment_id], max_results=500)
    parents = [r for r in runs if r.data.tags.get("rlflow.kind") == "parent"]
    children = {
        (r.data.tags["rlflow.round"], r.data.tags["rlflow.stage"]): r
        for r in runs
        if r.data.tags.get("rlflow.kind") == "child"
    }
    return client, parents, children


# Every kind of secret, as config values and as environment credentials: swept for at the end.
E2E_SECRETS = {
    "storage": "S3CR3T-VALUE-42",  # storage options are secret: never in logs, MLflow or Prefect
    "webhook": "WEBHOOK-TOKEN-9f3a",
    "header": "BEARER-7c1e",
    "data": "DATA-KEY-51d0",
    "aws": "AWS-SECRET-2b8e",
    "mlflow": "MLFLOW-PASSWORD-e4a2",
    "judge": "JUDGE-KEY-83c1",
    "mirror": "MIRROR-KEY-0d57",
}


def test_two_rounds_end_to_end(prefect_server, small_assets, tmp_path):
    root = tmp_path / "runs"
    secrets = E2E_SECRETS
    secret = secrets["storage"]
    tree = small_config_tree(
        small_assets,
        root,
        run={"name": "e2e", "rounds": 2, "storage_options": {"auto_mkdir": True, "secret_marker": secret}},
        stage={"rm": {"retries": 1, "retry_delay_s": 0, "hang_timeout_s": 15}},  # 0.1 s steps: margin for load
        alerts={
            "webhook_url": f"http://127.0.0.1:9/hook?token={secrets['webhook']}",
            "headers": {"Authorization": f"Bearer {secrets['header']}"},
        },
        data={"storage_options": {"auto_mkdir": False, "key_marker": secrets["data"]}},
        gold={"fn": "rlflow.engine.tasksets.demo:gold_score", "kwargs": {"api_key": secrets["judge"]}},  # a judge key
        checkpoint={"mirror": str(tmp_path / "mirror"), "mirror_storage_options": {"key_marker": secrets["mirror"]}},
    )
    config = write_config(tmp_path / "c.yaml", tree)
    # Round 0's reward model hangs once at step 3: the watchdog fails it, Prefect retries it, and
    # the retry resumes from the step-2 checkpoint.
    hang = dict(
        os.environ,
        RLFLOW_FAULT="rm:hang:3",
        RLFLOW_FAULT_ONCE=str(tmp_path / "hung-once"),
        AWS_SECRET_ACCESS_KEY=secrets["aws"],
        MLFLOW_TRACKING_PASSWORD=secrets["mlflow"],
    )
    first = finish(cli(config, "run.rounds=1", env=hang))
    assert "[round 0 rl] step 3/3" in first and secret not in first
    rm_lines = "\n".join(line for line in first.splitlines() if "rm]" in line or "hang" in line or "Retry" in line)
    assert "no step finished for 15 s" in first and "thread stacks" in first, rm_lines
    assert "[round 0 rm] step 3 (" in first and "checkpoint/resume_s=" in first, rm_lines  # resumed at 3
    rm_run = [t for t in prefect_task_runs(prefect_server, "e2e")[1][0] if t.name == "round-0-rm"][0]
    assert rm_run.run_count == 2 and rm_run.state.name == "Completed"
    # Adding a round continues the run: round 0 comes from the cache, round 1 trains.
    out = finish(cli(config))
    assert "[round 0 sft] step" not in out and "[round 1 rl] step 3/3" in out and "gold_score_before" in out
    assert secret not in out

    _check_summary_checkpoints_and_mlflow(root, secret, secrets, first + out)
    flow_runs, tasks = prefect_task_runs(prefect_server, "e2e")
    assert [fr.state.type.value for fr in flow_runs] == ["COMPLETED", "COMPLETED"]
    assert all(secret not in json.dumps(fr.parameters, default=str) for fr in flow_runs)
    assert [(t.name, t.state.name) for t in tasks[0]] == [
        (f"round-0-{s}", "Completed") for s in ("sft", "rm", "rl", "eval")
    ]
    assert [(t.name, t.state.name) for t in tasks[1]] == [
        (f"round-0-{s}", "Cached") for s in ("sft", "rm", "rl", "eval")
    ] + [(f"round-1-{s}", "Completed") for s in ("label", "rm", "rl", "eval")]

    # Every stage's output has its second copy on the mirror.
    mirror = tmp_path / "mirror" / "e2e"
    assert {p.parent.relative_to(mirror).as_posix() for p in mirror.glob("round_*/*/final.json")} == {
        f"round_{r}/{s}" for r, stages in ((0, ("sft", "rm", "rl", "eval")), (1, ("label", "rm", "rl", "eval")))
        for s in stages
    }
    # Same command again after the last stage's checkpoints were deleted by hand, on both copies:
    # every other stage comes from Prefect's cache, the deleted one is not trusted to the cache
    # and runs again.
    shutil.rmtree(root / "e2e" / "round_1" / "eval")
    shutil.rmtree(mirror / "round_1" / "eval")
    out = finish(cli(config))
    assert "[round 1 eval] step 1" in out and "[round 0 sft] step" not in out and "[round 1 rl] step" not in out
    flow_runs, tasks = prefect_task_runs(prefect_server, "e2e")
    states = [(t.name, t.state.name) for t in tasks[2]]
    assert states[:7] == [(name, "Cached") for name, _ in states[:7]]
    assert states[-1] == ("round-1-eval", "Completed")
    assert json.loads((root / "e2e" / "round_1" / "eval" / "final.json").read_text())["step"] == 0

    _check_a_changed_config_is_refused(config, root)
    _check_no_secret_in_any_file(tmp_path, secrets)

def _check_a_changed_config_is_refused(config, root):
    # Changing the config of a finished stage under the same run.name: refused, naming the key.
    proc = cli(config, "rl.clip_ratio=0.3")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("rlflow: error: stage round_0/rl") and "rl.clip_ratio" in last and "new run.name" in last
    assert "Traceback" not in out
    _, parents, _ = mlflow_runs(root)
    assert parents[0].data.params["rl.clip_ratio"] == "0.2"  # a refused change never reaches the params


ROUND_SUMMARY_FIELDS = "rm_accuracy gold_score_before gold_score_after gold_score_stderr kl response_length distinct_2"
ROUND_SUMMARY_FIELDS += " seconds"


def _check_summary_checkpoints_and_mlflow(root, secret, secrets, console):
    """Both rounds in summary.json, their checkpoints, one MLflow parent with a child per stage, the
    registered policy versions, and no secret in params, console output or the config artifact."""
    summary = json.loads((root / "e2e" / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    for row in summary["rounds"]:
        assert set(row) >= set(ROUND_SUMMARY_FIELDS.split())
        assert 0 <= row["gold_score_after"] <= 1
    assert (root / "e2e" / "round_0" / "rl" / "step_000003" / "manifest.json").exists()
    assert json.loads((root / "e2e" / "round_1" / "rl" / "final.json").read_text())["step"] == 3

    client, parents, children = mlflow_runs(root)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    # Each round's policy is a registry version whose source is its checkpoint (no copy).
    versions = sorted(client.search_model_versions("name = 'e2e-policy'"), key=lambda v: int(v.version))
    final_steps = [CheckpointStore(str(root / "e2e" / f"round_{r}" / "rl")) for r in (0, 1)]
    assert [v.source for v in versions] == [store.step_url(store.final()["step"]) for store in final_steps]
    assert set(children) == {
        ("0", "sft"),
        ("0", "rm"),
        ("0", "rl"),
        ("0", "eval"),
        ("1", "label"),
        ("1", "rm"),
        ("1", "rl"),
        ("1", "eval"),
    }
    for child in children.values():
        assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert child.info.status == "FINISHED"
        assert "checkpoint_uri.txt" in {a.path for a in client.list_artifacts(child.info.run_id)}
    assert parents[0].data.params["rl.steps"] == "3" and parents[0].data.params["run.name"] == "e2e"
    assert "config.yaml" in {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    ppo = children[("1", "rl")]
    assert [m.step for m in client.get_metric_history(ppo.info.run_id, "actor/pg_loss")] == [1, 2, 3]
    eval_artifacts = {a.path for a in client.list_artifacts(children[("1", "eval")].info.run_id)}
    assert {"eval_samples_after.json", "eval_gold_by_prompt.json"} <= eval_artifacts  # the latter: compare pairs

    for run in (parents[0], *children.values()):
        assert secret not in json.dumps(run.data.params)
    assert not any(value in console for value in secrets.values())
    assert secret not in (root / "mlartifacts").joinpath(*_artifact_path(parents[0], "config.yaml")).read_text()


def _check_no_secret_in_any_file(tmp_path, secrets):
    # No secret in any file the runs wrote: checkpoints and their metadata, mlflow.db, MLflow
    # artifacts, Prefect's results and its database (parameters, task run logs, states).
    prefect_home = Path(os.environ["PREFECT_HOME"])
    leaks = {
        f"{path}: {name}"
        for folder in (tmp_path, prefect_home)
        for path in folder.rglob("*")
        if path.name != "c.yaml"  # the user's own config file holds them
        for name, value in secrets.items()
        if value.encode() in _bytes_of(path)
    }
    assert leaks == set()
    assert (prefect_home / "prefect.db").stat().st_size > 0
    results = [p for p in Path(os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]).rglob("*") if p.is_file()]
    assert results and all(isinstance(json.loads(p.read_bytes()), dict) for p in results)  # JSON, never pickle


def _artifact_path(run, name):
    # artifact_uri: file://<root>/mlartifacts/<experiment id>/<run id>/artifacts
    parts = run.info.artifact_uri.split("/mlartifacts/")[1].split("/")
    return (*parts, name)


def test_sigkill_after_a_ppo_checkpoint_then_continue(prefect_server, small_assets, tmp_path):
    root = tmp_path / "runs"
    steps = 6
    tree = small_config_tree(
        small_assets, root, run={"name": "kill"}, rl={"steps": steps}, checkpoint={"every_steps": 2, "keep_last": 3}
    )
    config = write_config(tmp_path / "c.yaml", tree)
    # Killed between stages: SFT's final.json is written, the reward model has not started.
    between = cli(config, env=dict(os.environ, RLFLOW_FAULT="sft:after_final:40"))
    out, _ = between.communicate(timeout=300)
    assert between.returncode == 137, out[-3000:]
    round_0 = root / "kill" / "round_0"
    assert (round_0 / "sft" / "final.json").exists() and not (round_0 / "rm").exists()
    # The run blocks at the start of PPO step 3 (after step 2's checkpoint) until it is killed: however
    # slowly the refused process below starts on a loaded machine, the first one still holds the run.
    proc = cli(config, env=dict(os.environ, RLFLOW_FAULT="rl:hang:3"))
    wait_for(root / "kill" / "round_0" / "rm" / "step_000002" / "manifest.json", proc)  # the flow holds the lock
    # A second process on the same run.name while the first holds the run: refused by the lock.
    second = cli(config)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2 and out.strip().splitlines()[-1].startswith("rlflow: error: run ")
    assert "already being run by pid" in out and "Traceback" not in out, out[-2000:]
    wait_for(root / "kill" / "round_0" / "rl" / "step_000002" / "manifest.json", proc)
    proc.send_signal(signal.SIGKILL)
    killed_out, _ = proc.communicate()
    # SFT finished before the kill between stages, though Prefect never recorded its task result:
    # the engine's final.json is the truth, so nothing is trained again.
    assert "[round 0 sft] step" not in killed_out and "[round 0 rm] step" in killed_out
    store = CheckpointStore(str(root / "kill" / "round_0" / "rl"))
    resumed_from = store.latest()
    assert resumed_from == 2 and store.final() is None

    out = finish(cli(config))
    assert f"[round 0 rl] step {resumed_from + 1}/{steps}" in out
    assert "[round 0 sft] step" not in out and "[round 0 rm] step" not in out

    client, parents, children = mlflow_runs(root)
    assert len(parents) == 1
    ppo = children[("0", "rl")]
    assert ppo.data.tags["rlflow.resumed_from"] == str(resumed_from)
    for key in ("actor/pg_loss", "critic/score/mean", "actor/kl"):
        assert [m.step for m in client.get_metric_history(ppo.info.run_id, key)] == list(range(1, steps + 1)), key

    flow_runs, tasks = prefect_task_runs(prefect_server, "kill")
    # The refused one never started a flow run.
    assert [fr.state.type.value for fr in flow_runs] == ["CRASHED", "CRASHED", "COMPLETED"]
    states = {t.name: t.state.name for t in tasks[2]}
    assert states["round-0-sft"] == "Cached" and states["round-0-rm"] == "Cached"
    assert states["round-0-rl"] == "Completed" and states["round-0-eval"] == "Completed"


def test_one_round_with_checkpoints_on_s3(prefect_server, s3_bucket, small_assets, tmp_path):
    import s3fs

    url, options = s3_bucket
    tree = small_config_tree(
        small_assets,
        f"{url}/runs",
        run={"name": "s3run", "storage_options": options},
        tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"},
        rl={"steps": 2},
    )
    out = finish(cli(write_config(tmp_path / "c.yaml", tree)))
    assert f"final policy: {url}/runs/s3run/round_0/rl/step_000002" in out
    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    for stage in ("sft", "rm", "rl", "eval"):
        assert fs.exists(f"{url}/runs/s3run/round_0/{stage}/final.json"), stage
    summary = json.loads(fs.cat(f"{url}/runs/s3run/summary.json"))
    assert summary["rounds"][0]["round"] == 0
    assert not fs.exists(f"{url}/runs/s3run/.lock")
    # The endpoint is in storage_options: redacted in MLflow like any secret.
    _, parents, children = mlflow_runs(None, uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert set(children) == {("0", "sft"), ("0", "rm"), ("0", "rl"), ("0", "eval")}
    assert parents[0].data.params["run.storage_options"] == "***"


def _bytes_of(path: Path) -> bytes:
    """A file's bytes; nothing for a folder or a file gone since it was listed (the Prefect server,
    shared by the xdist workers, writes and removes its database journal while another test runs)."""
    try:
        return path.read_bytes() if path.is_file() else b""
    except FileNotFoundError:
        return b""
