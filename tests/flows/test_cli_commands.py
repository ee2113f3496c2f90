"""`rlflow run --dry-run`, `rlflow status` and `rlflow deploy`'s checks: what they print and
refuse, without training anything."""

import pytest
import yaml

from conftest import small_config_tree
from rlflow.engine.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.errors import ConfigError
from rlflow.engine.secrets import redact
from rlflow.flows.cli import main
from rlflow.flows.deploy import check_parameters, check_rlhf_deployment, load_deployments


def write_config(path, tree):
    path.write_text(yaml.safe_dump(tree))
    return path


def test_dry_run_prints_the_resolved_config_and_plan_without_a_model(tmp_path, small_assets, capsys):
    tree = small_config_tree(small_assets, tmp_path / "runs", run={"rounds": 2, "name": "dry"})
    tree["model"]["path"] = str(tmp_path / "no-such-model")  # nothing is loaded: no error
    tree["run"]["storage_options"] = {"key": "AKIA-SECRET-1"}
    config = write_config(tmp_path / "c.yaml", tree)
    assert main(["run", str(config), "ppo.steps=7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "AKIA-SECRET-1" not in out and "storage_options: '***'" in out
    resolved = yaml.safe_load(out.split("# plan:")[0])
    assert resolved["ppo"]["steps"] == 7 and resolved["run"]["name"] == "dry"
    plan = [line.split()[:4] for line in out.splitlines() if line.startswith("  round ")]
    assert plan == [
        ["round", "0", "sft", "40"], ["round", "0", "rm", "1"], ["round", "0", "ppo", "7"], ["round", "0", "eval", "32"],
        ["round", "1", "label", "32"], ["round", "1", "rm", "1"], ["round", "1", "ppo", "7"], ["round", "1", "eval", "32"],
    ]
    assert out.count("[not started]") == 8
    assert not (tmp_path / "runs" / "dry").exists()  # a dry run writes nothing


def test_status_reads_the_run_folder(tmp_path, small_assets, capsys):
    root = tmp_path / "runs"
    tree = small_config_tree(small_assets, root, run={"name": "st", "rounds": 1, "storage_options": {"anon": False}})
    (root / "st").mkdir(parents=True)
    (root / "st" / "config.yaml").write_text(yaml.safe_dump(redact(tree)))  # as the flow writes it
    sft = CheckpointStore(stage_prefix(str(root), "st", 0, "sft"))
    with sft.writer(40) as w:
        w.write_bytes("x", b"x")
    sft.mark_final(40)
    rm = CheckpointStore(stage_prefix(str(root), "st", 0, "rm"))
    with rm.writer(20) as w:
        w.write_bytes("x", b"x")
    (root / "st" / "events.jsonl").write_text('{"run": "st", "round": 0, "stage": "rm", "step": 25, "time": "T"}\n')
    assert main(["status", "st", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "sft" in out and "[done at step 40]" in out and "[at step 20 (committed)]" in out
    assert out.count("[not started]") == 2 and "last logged step: round 0 rm step 25" in out
    assert main(["status", "nope", "--root", str(root)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def deployment(config_path, overrides):
    return {
        "name": "d",
        "entrypoint": "flows/deployment.py:rlhf_next_round",
        "parameters": {"config_path": str(config_path), "overrides": overrides},
    }


def test_deploy_refuses_secrets_and_unnamed_runs(tmp_path, small_assets):
    config = write_config(tmp_path / "c.yaml", small_config_tree(small_assets, tmp_path / "runs", run={"name": None}))
    check_rlhf_deployment(deployment(config, ["run.name=n"]), tmp_path, tmp_path / "prefect.yaml")
    check_rlhf_deployment(  # a reference to a Secret block is not a secret
        deployment(config, ["run.name=n", "run.storage_options.secret=prefect-secret:s3-secret"]), tmp_path, tmp_path / "p"
    )
    with pytest.raises(ConfigError, match="override of run.storage_options.secret would store a secret"):
        check_rlhf_deployment(deployment(config, ["run.name=n", "run.storage_options.secret=abc"]), tmp_path, tmp_path / "p")
    with pytest.raises(ConfigError, match="leaves run.name empty"):
        check_rlhf_deployment(deployment(config, []), tmp_path, tmp_path / "p")
    tree = small_config_tree(small_assets, tmp_path / "runs", alerts={"webhook_url": "https://hooks.example/T0K3N"})
    leaky = write_config(tmp_path / "leaky.yaml", tree)
    with pytest.raises(ConfigError, match="holds secret value"):
        check_rlhf_deployment(deployment(leaky, ["run.name=n"]), tmp_path, tmp_path / "p")
    watcher = {"name": "w", "parameters": {"inbox": "s3://b/inbox", "storage_options": {"secret": "abc"}}}
    with pytest.raises(ConfigError, match="parameter\\(s\\) storage_options.secret would be stored by Prefect"):
        check_parameters(watcher, tmp_path / "p")
    check_parameters(watcher | {"parameters": {"inbox": "i", "storage_options": {"key": "prefect-secret:s3"}}}, tmp_path / "p")


def test_the_shipped_prefect_yaml_passes_its_own_checks():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    deployments = load_deployments(repo / "prefect.yaml", None)
    assert {d["name"] for d in deployments} == {"demo-nightly", "label-inbox", "gpu-nightly"}
    for d in deployments:
        if d["entrypoint"].endswith(":rlhf_next_round"):
            check_rlhf_deployment(d, repo, repo / "prefect.yaml")
    with pytest.raises(ConfigError, match="no deployment named nope; deployments: demo-nightly"):
        load_deployments(repo / "prefect.yaml", ["nope"])


class ListLogger:
    def __init__(self):
        self.lines = []

    def warning(self, message, *args):
        self.lines.append(message % args)


def test_a_continued_run_stays_in_the_mlflow_store_it_started_in(tmp_path, small_assets, monkeypatch):
    from rlflow.engine.config import build_config
    from rlflow.flows.rlhf import settle_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "runs"
    config = build_config(small_config_tree(small_assets, root, run={"name": "kept"}), "t")
    logger = ListLogger()
    first = settle_tracking_uri(config, logger)
    assert first == f"sqlite:///{root.resolve()}/mlflow.db" and logger.lines == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # `make up` since the run started
    assert settle_tracking_uri(config, logger) == first
    assert "keeps its MLflow store" in logger.lines[-1]
    explicit = build_config(small_config_tree(small_assets, root, run={"name": "kept"}, tracking={"uri": "http://x:5000"}), "t")
    assert settle_tracking_uri(explicit, logger) == "http://x:5000" and "is not the store" in logger.lines[-1]
    fresh = build_config(small_config_tree(small_assets, root, run={"name": "new"}), "t")
    assert settle_tracking_uri(fresh, logger) == "http://127.0.0.1:5000"  # a new run goes where it is told
