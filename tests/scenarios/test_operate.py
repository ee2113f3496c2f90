"""Operating rlflow as a service, against a real Prefect server, a real Prefect process worker and
a real MLflow server: `rlflow deploy`, a run started through the API, human labels exported,
labelled and imported, the watcher's event starting the next round through the deployment's
trigger; then what the rounds left: registry versions with lineage, `rlflow compare`, the HTML
report and `rlflow export`."""

import csv
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import small_config_tree, stop_process
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.tasksets.demo import gold_score
from rlflow.flows.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def deployments_file(path, config_path, pool):
    doc = {
        "name": "rlflow-test",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $RLFLOW_PROJECT_DIR }}"}}],
        "deployments": [
            {
                "name": "nightly",
                "entrypoint": "flows/deployment.py:rlhf_next_round",
                # Relative to the project (the repository), as in the shipped prefect.yaml.
                "parameters": {"config_path": os.path.relpath(config_path, REPO), "overrides": ["run.name=nightly"]},
                "work_pool": {
                    "name": pool,
                    "work_queue_name": "default",
                    "job_variables": {"env": {"RLFLOW_PROJECT_DIR": "{{ $RLFLOW_PROJECT_DIR }}"}},
                },
                "concurrency_limit": {"limit": 1, "collision_strategy": "ENQUEUE"},
                # inactive: a suite running across 02:00 UTC would otherwise get a second, scheduled run
                "schedules": [{"cron": "0 2 * * *", "timezone": "UTC", "active": False}],
                "triggers": [
                    {
                        "type": "event",
                        "enabled": True,
                        "expect": ["rlflow.labels.landed"],
                        "match": {"prefect.resource.id": "rlflow.labels.nightly"},
                    }
                ],
            }
        ],
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_worker(pool, tmp_path, fault_marker):
    env = dict(
        os.environ,
        PREFECT_WORKER_QUERY_SECONDS="1",
        # One hang in round 0's PPO: the watchdog fails the task, Prefect retries it (run_count 2).
        RLFLOW_FAULT="rl:hang:2",
        RLFLOW_FAULT_ONCE=str(fault_marker),
    )
    log = open(tmp_path / "worker.log", "wb")
    cmd = [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--type", "process"]
    # Started elsewhere than the project: the deployment's pull step must take each flow run there.
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    return proc, log


def wait_for_flow_run(client, deployment_id, not_in, timeout=600):
    """The first flow run of the deployment other than `not_in` (and any the schedule planned, were it
    active), once it is final."""
    from prefect.client.schemas.filters import DeploymentFilter

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment_id]}))
        started = [r for r in runs if r.id not in not_in and r.state_name != "Scheduled"]
        if started and started[0].state.is_final():
            return started[0]
        time.sleep(0.5)
    raise AssertionError(f"no flow run of deployment {deployment_id} finished in {timeout} s: {[r.state_name for r in runs]}")


def task_states(client, flow_run_id):
    from prefect.client.schemas.filters import FlowRunFilter

    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
    return {t.name: (t.state_name, t.run_count) for t in runs}


def label_by_gold(csv_path):
    """A rater: prefers the answer the demo task's gold function scores higher (ties left empty)."""
    rows = list(csv.DictReader(open(csv_path)))
    for row in rows:
        a, b = (gold_score(row["prompt"], row[k])["score"] for k in ("answer_a", "answer_b"))
        row["choice"] = "A" if a > b else "B" if b > a else ""
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return sum(1 for r in rows if r["choice"])


@pytest.fixture
def prefect_client(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Prefect read its settings when first imported: point this process at the test server.
    with temporary_settings(updates={PREFECT_API_URL: prefect_server}), get_client(sync_client=True) as client:
        yield client


def test_deploy_trigger_label_round_trip_then_registry_compare_report_export(
    prefect_client, mlflow_server, small_assets, tmp_path, capsys
):
    from prefect.deployments import run_deployment

    from rlflow.flows.deployment import watch_label_inbox

    root, inbox, pool = tmp_path / "runs", tmp_path / "inbox", f"test-cpu-{uuid.uuid4().hex[:6]}"
    tree = small_config_tree(
        small_assets,
        root,
        label={"human_inbox": str(inbox), "online_from_round": None},
        tracking={"uri": mlflow_server},
        rl={"steps": 3, "rollout_batch": 16, "mini_batch": 8, "epochs": 1},
        kl={"stop_above": None},
        sampling={"max_new_tokens": 12},
        # Steps take < 1 s on idle cores; 15 s keeps a step on a loaded machine from passing for the hang.
        stage={"rl": {"retries": 1, "retry_delay_s": 0, "hang_timeout_s": 15}},
    )
    config_path = tmp_path / "nightly.yaml"
    config_path.write_text(yaml.safe_dump(tree))

    # 1. `rlflow deploy`: the pool, the deployment with its schedule and its event trigger.
    assert main(["deploy", "--file", str(deployments_file(tmp_path / "prefect.yaml", config_path, pool)), "--project", str(REPO)]) == 0
    assert f"work pool {pool}: created (process)" in capsys.readouterr().out
    deployment = prefect_client.read_deployment_by_name("rlhf-next-round/nightly")
    assert deployment.parameters == {"config_path": os.path.relpath(config_path, REPO), "overrides": ["run.name=nightly"]}
    assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [("0 2 * * *", False)]
    automations = prefect_client.read_automations_by_name("nightly__automation_1")
    assert automations and automations[0].trigger.expect == {"rlflow.labels.landed"}

    worker, log = start_worker(pool, tmp_path, tmp_path / "fault-fired")
    try:
        # 2. A run through the API: round 0, with PPO's hang retried once.
        run_deployment("rlhf-next-round/nightly", timeout=0)
        first = wait_for_flow_run(prefect_client, deployment.id, not_in=())
        assert (first.name, first.state_name, first.run_count) == ("nightly", "Completed", 1), (tmp_path / "worker.log").read_text()[-3000:]
        assert task_states(prefect_client, first.id) == {
            "round-0-sft": ("Completed", 1),
            "round-0-rm": ("Completed", 1),
            "round-0-rl": ("Completed", 2),  # the watchdog's StageHung, then a retry resumed from step 2
            "round-0-eval": ("Completed", 1),
        }
        assert (tmp_path / "fault-fired").exists()

        # 3. Raters label round 0's candidates; the import lands in the inbox; the watcher's event
        # makes the trigger start round 1, whose reward model trains on those labels.
        assert main(["label", "export", "nightly", "--round", "0", "--root", str(root), "--out", str(tmp_path / "l"), "--n", "24"]) == 0
        labelled = label_by_gold(tmp_path / "l" / "nightly-round0-candidates.csv")
        assert labelled >= 5
        assert main(["label", "import", str(tmp_path / "l" / "nightly-round0-candidates.csv"), "--root", str(root)]) == 0
        announced = watch_label_inbox(str(inbox))["announced"]
        assert [Path(p).name for p in announced] == ["round_0.jsonl"]
        assert watch_label_inbox(str(inbox)) == {"announced": []}  # announced once
        second = wait_for_flow_run(prefect_client, deployment.id, not_in={first.id})
        assert (second.name, second.state_name) == ("nightly", "Completed"), (tmp_path / "worker.log").read_text()[-3000:]
        states = task_states(prefect_client, second.id)
        assert {k: v[0] for k, v in states.items() if k.startswith("round-0")} == {
            f"round-0-{s}": "Cached" for s in ("sft", "rm", "rl", "eval")
        }
        assert {k: v for k, v in states.items() if k.startswith("round-1")} == {
            f"round-1-{s}": ("Completed", 1) for s in ("rm", "rl", "eval")
        }
    finally:
        stop_process(worker)
        log.close()
    rm = CheckpointStore(stage_prefix(str(root), "nightly", 1, "rm"))
    labels = rm.final()["identity_tree"]["upstream"]["labels"]  # the label stages' manifests, the human files' bytes
    human = [label for label in labels if label.startswith("sha256:")]
    assert len(human) == 1 and len(human[0]) == len("sha256:") + 64

    check_registry_compare_report_export(root, mlflow_server, tmp_path, capsys)


def check_registry_compare_report_export(root, mlflow_server, tmp_path, capsys):
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("rlflow")
    runs = client.search_runs([experiment.experiment_id], "tags.`rlflow.run_name` = 'nightly'")
    parent = runs[0]
    children = {
        (r.data.tags["rlflow.round"], r.data.tags["rlflow.stage"]): r
        for r in client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    }
    # One registered version per round, pointing at its checkpoint, with its lineage.
    versions = sorted(client.search_model_versions("name = 'nightly-policy'"), key=lambda v: int(v.version))
    assert [v.tags["rlflow.round"] for v in versions] == ["0", "1"]
    for version in versions:
        r = version.tags["rlflow.round"]
        rl = CheckpointStore(stage_prefix(str(root), "nightly", int(r), "rl"))
        assert version.tags["rlflow.checkpoint_uri"] == rl.step_url(rl.final()["step"])
        assert version.tags["rlflow.reward_model_run_id"] == children[(r, "rm")].info.run_id
        assert version.tags["rlflow.rl_run_id"] == children[(r, "rl")].info.run_id == version.run_id
        assert version.tags["rlflow.parent_run_id"] == parent.info.run_id
        # A server refuses a local path as a source (tasks/tracking.py): the RL run stands in.
        assert version.source == f"runs:/{version.run_id}"
        assert len(version.tags["rlflow.data.preferences"]) == 64  # a sha256 of the data file

    png = tmp_path / "compare.png"
    capsys.readouterr()
    assert main(["compare", "nightly", "--tracking-uri", mlflow_server, "--root", str(root), "--out", str(png)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["run", "round", "gold_before", "gold_after"]
    assert [line.split()[:2] for line in table[1:3]] == [["nightly", "0"], ["nightly", "1"]]
    gold_after_round_0 = float(table[1].split()[3])
    assert gold_after_round_0 == pytest.approx(children[("0", "eval")].data.metrics["eval/gold_score"], abs=1e-4)
    # The cost column: the round's stage seconds on one CPU at its configs/prices.yaml hourly price.
    assert table[0].split()[-2:] == ["seconds", "cost_USD"]
    cpu_price = yaml.safe_load((Path(__file__).parents[2] / "configs" / "prices.yaml").read_text())["devices"]["cpu"]
    seconds, cost = (float(x) for x in table[1].split()[-2:])
    assert cost == pytest.approx(seconds * cpu_price["price_per_gpu_hour"] / 3600, rel=1e-2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.html", "curves.png", "summary.json", "config.yaml"} <= artifacts
    assert "compare/compare.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "compare")}
    report = (root / "nightly" / "report.html").read_text()
    assert "Round 1: sample responses of the final policy" in report and report.count("<tr>") >= 2 + 2 * 4

    out = tmp_path / "hf"
    assert main(["export", "nightly", "--round", "1", "--to", str(out)]) == 2  # --root is needed: not ./runs
    assert main(["export", "nightly", "--round", "1", "--to", str(out), "--root", str(root)]) == 0
    card = (out / "README.md").read_text()
    assert "nightly-policy version 2" in card and parent.info.run_id in card
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.num_parameters() > 0 and tokenizer("hello").input_ids
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".pt", ".bin", ".pkl")) == []


def test_secret_block_references_resolve_at_run_time(prefect_client):
    from prefect.blocks.system import Secret

    from rlflow.engine.errors import ConfigError
    from rlflow.flows.deployment import resolve_secret_refs

    name = f"s3-key-{uuid.uuid4().hex[:6]}"
    Secret(value="AKIA-REAL-KEY").save(name)
    tree = {"run": {"storage_options": {"key": f"prefect-secret:{name}", "anon": False}}, "n": ["prefect-secret:" + name]}
    assert resolve_secret_refs(tree) == {"run": {"storage_options": {"key": "AKIA-REAL-KEY", "anon": False}}, "n": ["AKIA-REAL-KEY"]}
    with pytest.raises(ConfigError, match="no Prefect Secret block named 'missing-block'"):
        resolve_secret_refs({"k": "prefect-secret:missing-block"})
