"""`rlflow deploy`: check prefect.yaml's deployments, create their work pools, register them.

Checked before anything reaches the server: every RLHF deployment's config loads with its
overrides, names its run, and holds no secret (a literal credential in the file or the
overrides would be stored by Prefect as a parameter); a secret must be an environment
credential or a "prefect-secret:<block>" reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlflow.engine.config.schema import load_config
from rlflow.engine.config.yaml_io import parse_yaml, read_text
from rlflow.engine.errors import ConfigError
from rlflow.engine.config.secrets import is_secret_path, split_secrets

# Pool name -> (type, base job template file or None for Prefect's default of that type).
POOL_TYPES = {"process": None, "kubernetes": "infra/k8s/gpu-job-template.json"}
RLHF_ENTRYPOINT = "flows/deployment.py:rlhf_next_round"


def load_deployments(path: Path, names: list[str] | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (the deployments file, e.g. prefect.yaml)")
    doc = parse_yaml(path, read_text(path)) or {}
    deployments = doc.get("deployments") or []
    known = [d.get("name") for d in deployments]
    if names:
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ConfigError(f"{path}: no deployment named {', '.join(unknown)}; deployments: {', '.join(known)}")
        deployments = [d for d in deployments if d.get("name") in names]
    return deployments


def check_parameters(deployment: dict[str, Any], source: Path) -> None:
    """No deployment parameter may hold a literal secret: Prefect stores parameters."""
    leaked = [
        key
        for key, value in _leaves(deployment.get("parameters") or {})
        if is_secret_path(tuple(key.split("."))) and value not in (None, {}, "") and not _is_ref(value)
    ]
    if leaked:
        raise ConfigError(
            f"{source}: deployment {deployment.get('name')!r}: parameter(s) {', '.join(leaked)} would be stored by"
            " Prefect; use environment credentials or prefect-secret:<block name>"
        )


def _is_ref(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("prefect-secret:")


def check_rlhf_deployment(deployment: dict[str, Any], project: Path, source: Path) -> None:
    """The config of an rlhf_next_round deployment: loads, names its run, holds no secret."""
    name, params = deployment.get("name"), deployment.get("parameters") or {}
    where = f"{source}: deployment {name!r}"
    config_path = params.get("config_path")
    if not config_path:
        raise ConfigError(f"{where}: parameters.config_path is required (a config file relative to the project)")
    overrides = list(params.get("overrides") or [])
    for override in overrides:
        key, _, value = override.partition("=")
        if is_secret_path(tuple(key.strip().split("."))) and not _is_ref(value):
            raise ConfigError(
                f"{where}: override of {key.strip()} would store a secret as a Prefect parameter;"
                f" use an environment credential or a Secret block: {key.strip()}=prefect-secret:<block name>"
            )
    config = load_config(project / config_path, overrides)
    if config.run.name is None:
        raise ConfigError(f"{where}: the config leaves run.name empty; add run.name=<name> to its overrides")
    _, secrets = split_secrets(config.model_dump(mode="json"))
    literal = [key for key, value in _leaves(secrets) if not _is_ref(value)]
    if literal:
        raise ConfigError(
            f"{where}: {config_path} holds secret value(s) at {', '.join(literal)}; a deployment stores its"
            " parameters: use environment credentials or prefect-secret:<block name>"
        )


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [(prefix.rstrip("."), tree)]


def ensure_pools(deployments: list[dict[str, Any]], project: Path, pool_types: dict[str, str]) -> list[str]:
    """Create each deployment's work pool if missing; returns what was done, one line each."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    done = []
    with get_client(sync_client=True) as client:
        for pool in sorted({(d.get("work_pool") or {}).get("name") for d in deployments} - {None}):
            try:
                client.read_work_pool(pool)
                done.append(f"work pool {pool}: exists")
                continue
            except ObjectNotFound:
                pass
            kind = pool_types.get(pool, "process")
            template_file = POOL_TYPES[kind]
            template = json.loads((project / template_file).read_text()) if template_file else None
            create = WorkPoolCreate(name=pool, type=kind, **({"base_job_template": template} if template else {}))
            client.create_work_pool(work_pool=create)
            done.append(f"work pool {pool}: created ({kind})")
    return done


def deploy(path: Path, project: Path, names: list[str] | None, pool_types: dict[str, str]) -> list[str]:
    """Check, create pools, then `prefect deploy` each selected deployment; output lines."""
    deployments = load_deployments(path, names)
    for deployment in deployments:
        check_parameters(deployment, path)
        if deployment.get("entrypoint") == RLHF_ENTRYPOINT:
            check_rlhf_deployment(deployment, project, path)
    lines = ensure_pools(deployments, project, pool_types)
    argv = [str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--prefect-file", str(path)]
    for deployment in deployments:
        argv += ["--name", deployment["name"]]
    env = dict(os.environ, RLFLOW_PROJECT_DIR=str(project.absolute()))
    done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"prefect deploy failed for {path}: {(done.stdout + done.stderr).strip()[-1500:]}")
    return lines + [f"deployment {d.get('name')}: registered" for d in deployments]


def command_deploy(args: argparse.Namespace) -> int:
    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError("deployments need a Prefect server: `make up`, or set PREFECT_API_URL")
    pool_types = dict(item.split("=", 1) for item in args.pool_type)
    for line in deploy(
        Path(args.file), Path(args.project), args.name or None, {"rlflow-gpu": "kubernetes"} | pool_types
    ):
        print(line)
    print(
        f"start a worker: prefect worker start --pool rlflow-cpu   (UI: {os.environ['PREFECT_API_URL'][:-4]}/deployments)"
    )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("deploy", help="register prefect.yaml's deployments (schedules, triggers) and work pools")
    p.add_argument("--file", default="prefect.yaml")
    p.add_argument("--project", default=".", help="the folder configs and entrypoints are relative to")
    p.add_argument("--name", action="append", help="only this deployment (repeatable; default: all)")
    p.add_argument("--pool-type", action="append", default=[], metavar="POOL=TYPE", help="e.g. rlflow-gpu=kubernetes")
    p.set_defaults(handler=command_deploy)
