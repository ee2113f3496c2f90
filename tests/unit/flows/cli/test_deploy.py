"""`rlflow deploy`'s checks (flows/cli/deploy.py): what a deployment may not store (secrets, an
unnamed run), and the shipped prefect.yaml passing them."""

import pytest

from conftest import small_config_tree
from helpers.pipeline import write_config
from rlflow.engine.errors import ConfigError
from rlflow.flows.cli.deploy import check_parameters, check_rlhf_deployment, load_deployments


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

    repo = Path(__file__).resolve().parents[4]
    deployments = load_deployments(repo / "prefect.yaml", None)
    assert {d["name"] for d in deployments} == {"demo-nightly", "label-inbox", "gpu-nightly"}
    for d in deployments:
        if d["entrypoint"].endswith(":rlhf_next_round"):
            check_rlhf_deployment(d, repo, repo / "prefect.yaml")
    with pytest.raises(ConfigError, match="no deployment named nope; deployments: demo-nightly"):
        load_deployments(repo / "prefect.yaml", ["nope"])
