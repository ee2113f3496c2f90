"""The flows that deployments run (prefect.yaml): the next round of a run, and the watcher that
turns human labels landing in label.human_inbox into a Prefect event.

A deployment's parameters are a config path and overrides, never a config tree: what Prefect
stores holds no secret. Credentials come from the worker's environment (s3fs reads AWS_*) or
from Prefect Secret blocks named in the config as "prefect-secret:<block name>", resolved here
at run time and never stored.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from fsspec.core import url_to_fs
from prefect import flow, get_run_logger
from prefect.blocks.system import Secret
from prefect.events import emit_event
from prefect.runtime import flow_run

from rlflow.engine.config.schema import Config, load_config
from rlflow.engine.errors import ConfigError
from rlflow.engine.config.secrets import merge_trees, split_secrets
from rlflow.flows.plan import read_run_file
from rlflow.flows.preflight import check_inputs
from rlflow.flows.rlhf import run_pipeline

SECRET_REF = "prefect-secret:"
LABELS_EVENT = "rlflow.labels.landed"


def resolve_secret_refs(tree: Any) -> Any:
    """A copy of `tree` with every "prefect-secret:<name>" string replaced by that Secret block's value."""
    if isinstance(tree, dict):
        return {k: resolve_secret_refs(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [resolve_secret_refs(v) for v in tree]
    if isinstance(tree, str) and tree.startswith(SECRET_REF):
        name = tree[len(SECRET_REF) :]
        try:
            return Secret.load(name).get()
        except ValueError:
            raise ConfigError(f"config value {tree!r}: no Prefect Secret block named {name!r}") from None
    return tree


def rounds_done(config: Config) -> int:
    summary = read_run_file(config.run.root, config.run.name, "summary.json", config.run.storage_options)
    return len(json.loads(summary)["rounds"]) if summary else 0


def _run_name() -> str:
    """The flow run's name is the run's name, as for `rlflow run` (stale-run detection relies on it)."""
    params = flow_run.get_parameters()
    config = load_config(params["config_path"], params.get("overrides") or [])
    return config.run.name or "unnamed"


@flow(name="rlhf-next-round", flow_run_name=_run_name, result_serializer="json")
def rlhf_next_round(config_path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the next round of the config's run (run.name must be set): rounds already finished
    are skipped (cached), the first missing one runs. A first call runs round 0."""
    config = load_config(config_path, overrides or [])
    if config.run.name is None:
        raise ConfigError(
            f"{config_path}: a deployment continues one run: set run.name (e.g. overrides: [run.name=nightly])"
        )
    target = rounds_done(config) + 1
    config = config.model_copy(update={"run": config.run.model_copy(update={"rounds": target})})
    get_run_logger().info("run '%s': round %d of a deployment", config.run.name, target - 1)
    public, secret = split_secrets(config.model_dump(mode="json"))
    secret = resolve_secret_refs(secret)
    check_inputs(Config.model_validate(merge_trees(public, secret)))
    return run_pipeline(public, secret, config_path)


@flow(name="rlflow-label-inbox", result_serializer="json")
def watch_label_inbox(inbox: str, storage_options: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """Emit `rlflow.labels.landed` once per new `<inbox>/<run>/round_<n>.jsonl` (the file, its
    run and round in the event's resource); a deployment trigger starts the run's next round.

    What was announced is marked beside the file (`.announced/<name>.<sha256 prefix>`), so a
    replaced file (`label import --replace`) is announced again. The mark is written before the
    event: a crash between them loses that event (the nightly schedule still runs the round)
    rather than starting a round twice."""
    fs, base = url_to_fs(inbox, **resolve_secret_refs(storage_options or {}))
    announced = []
    for path in sorted(fs.glob(f"{base.rstrip('/')}/*/round_*.jsonl")):
        match = re.search(r"([^/]+)/(round_(\d+)\.jsonl)$", path)
        if match is None:
            continue
        run, name, round_index = match[1], match[2], match[3]
        digest = hashlib.sha256(fs.cat_file(path)).hexdigest()[:16]
        mark = f"{path.rsplit('/', 1)[0]}/.announced/{name}.{digest}"
        if fs.exists(mark):
            continue
        fs.makedirs(mark.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(mark, b"")
        emit_event(
            event=LABELS_EVENT,
            resource={
                "prefect.resource.id": f"rlflow.labels.{run}",
                "rlflow.run": run,
                "rlflow.round": round_index,
                "rlflow.file": fs.unstrip_protocol(path),
            },
        )
        announced.append(path)
    if announced:
        get_run_logger().info("announced %d new label file(s): %s", len(announced), announced)
    return {"announced": announced}
