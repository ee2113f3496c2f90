"""MLflow tracking for a run: one parent run per rlflow run, one child run per (round, stage).

Every call goes through `MlflowClient` with explicit run ids: MLflow's fluent "active run" lives
in thread-local state that worker threads and processes do not share, so it cannot describe a
flow whose stages run elsewhere. Runs are found by tags rather than remembered ids, so a killed
and continued run re-attaches to the runs it already created instead of duplicating them.
This is the only module (with flows/tasks) that imports mlflow; the engine logs through the
`MetricsSink` protocol that `MlflowSink` implements.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from rlflow.engine.config.secrets import flatten, redact

log = logging.getLogger(__name__)

TAG_RUN_NAME = "rlflow.run_name"
TAG_KIND = "rlflow.kind"
TAG_ROUND = "rlflow.round"
TAG_STAGE = "rlflow.stage"
TAG_CRASHED = "rlflow.crashed"
TAG_PARENT = "mlflow.parentRunId"
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
CONFIG_ARTIFACT = "config.yaml"
# MLflow accepts these characters in param/metric names; anything else in a free-form config key
# (e.g. labeller kwargs) would make the whole batch fail.
_BAD_KEY_CHARS = re.compile(r"[^\w./\- :]")
T = TypeVar("T")


def resolve_tracking_uri(configured: str | None, root: str) -> str:
    """The tracking URI: `configured`, else $MLFLOW_TRACKING_URI, else a sqlite db under the run root.

    A remote root (s3://...) cannot hold a sqlite file, so the db then goes to ./runs locally.
    """
    if configured:
        return configured
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if root.startswith("file://"):
        root = root[len("file://") :]
    elif "://" in root:
        root = "runs"
    directory = Path(root).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{directory}/mlflow.db"


def _artifact_location(tracking_uri: str) -> str | None:
    """A local artifact dir next to a sqlite db; None (server default) for any other store.

    Without this, MLflow puts artifacts of a sqlite-backed experiment under ./mlruns of whatever
    directory the process happened to start in.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db_path = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    if db_path in ("", ":memory:"):
        return None
    return (Path(db_path).expanduser().resolve().parent / "mlartifacts").as_uri()


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _quoted(value: str) -> str:
    """A search-filter string literal; MLflow's filter grammar has no reliable quote escaping."""
    if "'" in value:
        raise ValueError(f"tracking: {value!r} cannot be searched for (contains a single quote)")
    return f"'{value}'"


def _param_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)[:MAX_ENTITY_KEY_LENGTH]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _now_ms() -> int:
    return int(time.time() * 1000)


class _ClientHolder:
    """Creates the MlflowClient lazily and drops it when pickled (it holds a DB engine), so
    trackers and sinks can be shipped to worker processes and reconnect there."""

    tracking_uri: str
    _client: MlflowClient | None = None

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        return state


class MlflowSink(_ClientHolder):
    """MetricsSink writing to one MLflow run, logging each (metric key, step) at most once.

    A resumed stage recomputes the steps between its last checkpoint and the kill; those steps
    are already in MLflow, so they are skipped (first value wins) and every step appears exactly
    once in the metric history. The max logged step per key is read lazily, once per key.
    """

    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self._max_step: dict[str, int] = {}
        self._keys_in_store: set[str] | None = None  # keys with any history when first used

    def __getstate__(self) -> dict[str, Any]:
        # Another process may log to the run meanwhile: reload what is there after unpickling.
        state = super().__getstate__()
        state["_max_step"], state["_keys_in_store"] = {}, None
        return state

    def _logged_up_to(self, key: str) -> int:
        if key not in self._max_step:
            if self._keys_in_store is None:
                # One get_run tells which keys exist at all, so new keys cost no history query.
                self._keys_in_store = set(self.client.get_run(self.run_id).data.metrics)
            history = self.client.get_metric_history(self.run_id, key) if key in self._keys_in_store else []
            self._max_step[key] = max((m.step for m in history), default=-(2**63))
        return self._max_step[key]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log `metrics` at `step`, skipping keys already logged at this step or a later one."""
        step, timestamp = int(step), _now_ms()
        batch = [
            Metric(key, float(value), timestamp, step)
            for key, value in metrics.items()
            if step > self._logged_up_to(key)
        ]
        for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=list(chunk))
        for metric in batch:
            self._max_step[metric.key] = step

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Log rows as a JSON table artifact; a table already stored under `name` is kept.

        MlflowClient.log_table appends to an existing file of the same name, which would repeat
        rows when a resumed stage re-logs a step's table; first write wins, as for metrics.
        """
        if not name.endswith(".json"):
            raise ValueError(f"tracking: table name {name!r} must end with .json")
        directory = os.path.dirname(name) or None
        if any(f.path == name for f in self.client.list_artifacts(self.run_id, directory)):
            log.info("tracking: table %s already logged to run %s; keeping it", name, self.run_id)
            return
        columns: dict[str, list[Any]] = {}
        for row in rows:  # union of keys, in first-seen order
            for key in row:
                columns.setdefault(key, [])
        for row in rows:
            for key, values in columns.items():
                values.append(row.get(key))
        self.client.log_table(self.run_id, data=columns, artifact_file=name)

    def log_text(self, name: str, text: str) -> None:
        """Write `text` to artifact `name` (replacing any previous version)."""
        self.client.log_text(self.run_id, text, name)


class RunTracker(_ClientHolder):
    """Finds or creates the parent/child runs of one rlflow run in one MLflow experiment."""

    def __init__(self, tracking_uri: str, experiment_name: str):
        self.tracking_uri, self.experiment_name = tracking_uri, experiment_name
        self._experiment_id: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_experiment_id"] = None
        return state

    @property
    def experiment_id(self) -> str:
        """The experiment's id, creating it (with a local artifact dir for sqlite) if needed."""
        if self._experiment_id is None:
            self._experiment_id = self._get_or_create_experiment()
        return self._experiment_id

    def _get_or_create_experiment(self) -> str:
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                # A deleted name cannot be re-created; restoring keeps the old runs findable.
                log.warning("tracking: restoring deleted experiment %r", self.experiment_name)
                self.client.restore_experiment(experiment.experiment_id)
            return experiment.experiment_id
        try:
            return self.client.create_experiment(
                self.experiment_name, artifact_location=_artifact_location(self.tracking_uri)
            )
        except MlflowException as exc:
            # Another process created it between our lookup and create.
            if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            return self.client.get_experiment_by_name(self.experiment_name).experiment_id

    def _find_run(self, tags: dict[str, str]) -> Any | None:
        """The oldest active run in the experiment carrying all `tags` (oldest: if two processes
        raced to create it, everyone settles on the same one)."""
        filter_string = " and ".join(f"tags.`{k}` = {_quoted(v)}" for k, v in tags.items())
        runs = self.client.search_runs(
            [self.experiment_id], filter_string, max_results=1, order_by=["attributes.start_time ASC"]
        )
        return runs[0] if runs else None

    def _get_run(self, run_id: str) -> Any | None:
        """The run `run_id` if the store has it and it is not deleted, else None. Any other failure
        (an unreachable server) raises: a run must not move to a new parent over an outage."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code not in (ErrorCode.Name(RESOURCE_DOES_NOT_EXIST), ErrorCode.Name(INVALID_PARAMETER_VALUE)):
                raise
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def _reactivate(self, run: Any) -> None:
        if run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")

    def parent_run(
        self,
        run_name: str,
        config_tree: dict[str, Any] | Any,
        known_id: str | None = None,
        by_name: bool = True,
        record: Callable[[str], None] | None = None,
    ) -> str:
        """The parent run's id for `run_name`: re-attached (set RUNNING again) if it exists.

        `known_id`: the parent the run's folder recorded, re-attached if the store still has it;
        otherwise, if `by_name`, the oldest parent tagged with `run_name`; else a new run (a run
        folder deleted and started again under the same name is a new run, not the old one's
        continuation, whose MLflow run keeps its history). `record(run_id)` is called whenever the
        parent is not `known_id`, before anything is logged to it (a crash leaves no parent
        unrecorded). Logs the flattened, redacted config as params (only keys not yet present:
        params are immutable) and the redacted config as `config.yaml` (only if missing, so it
        keeps describing the config the params came from).
        """
        if hasattr(config_tree, "model_dump"):  # a pydantic Config is accepted too
            config_tree = config_tree.model_dump(mode="json")
        tags = {TAG_RUN_NAME: run_name, TAG_KIND: "parent"}
        run = self._get_run(known_id) if known_id else None
        if run is not None and run.data.tags.get(TAG_RUN_NAME) != run_name:  # a folder copied from another run
            run = None
        if run is None and by_name:
            run = self._find_run(tags)
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        else:
            self._reactivate(run)
        run_id = run.info.run_id
        if record is not None and run_id != known_id:
            record(run_id)
        safe_tree = redact(config_tree)
        self._log_params(run_id, flatten(safe_tree), run.data.params)
        if not any(f.path == CONFIG_ARTIFACT for f in self.client.list_artifacts(run_id)):
            self.client.log_text(run_id, yaml.safe_dump(safe_tree, sort_keys=False), CONFIG_ARTIFACT)
        return run_id

    def _log_params(self, run_id: str, flat: dict[str, Any], existing: dict[str, str]) -> None:
        params = {_param_key(k): _clip(str(v), MAX_PARAM_VAL_LENGTH) for k, v in flat.items()}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            # MLflow params cannot change; say so instead of failing the continued run.
            log.warning("tracking: run %s keeps its first value for changed params: %s", run_id, changed)
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=list(chunk))

    def probe_run(self, name: str, params: dict[str, Any]) -> str:
        """A new run for one `rlflow probe` (tag rlflow.kind=probe, beside the pipelines' runs)."""
        run = self.client.create_run(self.experiment_id, run_name=name, tags={TAG_RUN_NAME: name, TAG_KIND: "probe"})
        self._log_params(run.info.run_id, flatten(redact(params)), {})
        return run.info.run_id

    def child_run(self, parent_id: str, round_index: int, stage: str) -> str:
        """The child run for (round, stage) under `parent_id`, created if missing.

        An existing child is set RUNNING again: it is fetched because its stage is about to run
        (e.g. resumed after a crash), and `finish` closes it afterwards.
        """
        tags = {TAG_PARENT: parent_id, TAG_KIND: "child", TAG_ROUND: str(int(round_index)), TAG_STAGE: stage}
        run = self._find_run(tags)
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=f"round_{int(round_index)}/{stage}", tags=tags)
        else:
            self._reactivate(run)
        return run.info.run_id

    def sink(self, run_id: str) -> MlflowSink:
        return MlflowSink(self.tracking_uri, run_id)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"tracking: status {status!r} must be one of {', '.join(TERMINAL_STATUSES)}")
        self.client.set_terminated(run_id, status=status)

    def log_bytes(self, run_id: str, name: str, data: bytes) -> None:
        """Write `data` to artifact `name` (e.g. "compare/curves.png"), replacing a previous version."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(name).name
            path.write_bytes(data)
            parent = str(Path(name).parent)
            self.client.log_artifact(run_id, str(path), None if parent == "." else parent)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        batch = [RunTag(k, _clip(str(v), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for chunk in _chunks(batch, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=list(chunk))

    def mark_crashed_children(self, parent_id: str) -> list[str]:
        """Set children left RUNNING by a killed process to KILLED, tagged rlflow.crashed=true.

        Returns their run ids. Call before continuing a run, while no stage of it is running.
        """
        filter_string = (
            f"tags.`{TAG_PARENT}` = {_quoted(parent_id)} and tags.`{TAG_KIND}` = 'child'"
            " and attributes.status = 'RUNNING'"
        )
        crashed = [run.info.run_id for run in self._search_all(filter_string)]
        for run_id in crashed:
            self.set_tags(run_id, {TAG_CRASHED: "true"})
            self.client.set_terminated(run_id, status="KILLED")
        return crashed

    def _search_all(self, filter_string: str) -> Iterable[Any]:
        page_token = None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string, page_token=page_token)
            yield from page
            page_token = page.token
            if not page_token:
                return


def tracking_client(configured: str | None, root: str) -> MlflowClient:
    """A client of the store a run with tracking.uri=`configured` and run.root=`root` used."""
    return MlflowClient(tracking_uri=resolve_tracking_uri(configured, root))


def registered_model_name(run_name: str) -> str:
    return f"{run_name}-policy"


def register_policy(
    client: MlflowClient, run_name: str, round_index: int, source_run_id: str, tags: dict[str, str]
) -> str:
    """Register round `round_index`'s final policy as a version of `<run>-policy`, pointing at
    its checkpoint (tags["rlflow.checkpoint_uri"]; no copy of the weights). Returns the version.

    A continued run registers each round's policy once: an existing version of the round with the
    same checkpoint manifest is returned.
    An MLflow server refuses a local path as a source (only its own artifact paths may be
    local), so for a local checkpoint under a server the source is the PPO run (`runs:/...`)
    and the checkpoint URI is in the tags either way.
    """
    name = registered_model_name(run_name)
    try:
        client.create_registered_model(name, tags={TAG_RUN_NAME: run_name})
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    manifest = tags["rlflow.manifest_sha256"]
    for version in client.search_model_versions(f"name = {_quoted(name)}"):
        # A retrained round (a new manifest) gets a new version.
        if version.tags.get(TAG_ROUND) == str(round_index) and version.tags.get("rlflow.manifest_sha256") == manifest:
            return str(version.version)
    tags = {k: _clip(str(v), MAX_TAG_VAL_LENGTH) for k, v in (tags | {TAG_ROUND: str(round_index)}).items()}
    uri = tags["rlflow.checkpoint_uri"]
    try:
        version = client.create_model_version(name, source=uri, run_id=source_run_id, tags=tags)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(INVALID_PARAMETER_VALUE) or "://" in uri:
            raise
        version = client.create_model_version(name, source=f"runs:/{source_run_id}", run_id=source_run_id, tags=tags)
    return str(version.version)


def round_version(client: MlflowClient, run_name: str, round_index: int) -> Any | None:
    """The registered version of round `round_index`'s policy (the newest, if the round was trained
    again under a new manifest); None if none is registered."""
    versions = client.search_model_versions(f"name = {_quoted(registered_model_name(run_name))}")
    mine = [v for v in versions if v.tags.get(TAG_ROUND) == str(round_index)]
    return max(mine, key=lambda v: int(v.version), default=None)


CHAMPION_ALIAS = "champion"
TAG_PROMOTION = "rlflow.promotion"
TAG_OVERRIDE = "rlflow.promotion.override"  # "<who>: <why>" of `rlflow promote`


def record_promotion(
    client: MlflowClient, run_name: str, version: str, failed_gates: dict[str, str], override: str | None
) -> None:
    """Tag round `version` promoted (no gate failed, or `override`: who promoted it by hand and why)
    or rejected. Each failed gate is `rlflow.rejected.<gate>=<reason>`, kept on a version promoted by
    hand as the record of what the gates said. Idempotent: a continued run records every round
    again, and a round decided again under new gates loses its stale tags."""
    name = registered_model_name(run_name)
    old = client.get_model_version(name, version).tags
    for key in old:
        stale_gate = key.startswith("rlflow.rejected.") and key.removeprefix("rlflow.rejected.") not in failed_gates
        if stale_gate or (key == TAG_OVERRIDE and override is None):
            client.delete_model_version_tag(name, version, key)
    promoted = not failed_gates or override is not None
    client.set_model_version_tag(name, version, TAG_PROMOTION, "promoted" if promoted else "rejected")
    for gate, reason in failed_gates.items():
        client.set_model_version_tag(name, version, f"rlflow.rejected.{gate}", _clip(reason, MAX_TAG_VAL_LENGTH))
    if override is not None:
        client.set_model_version_tag(name, version, TAG_OVERRIDE, _clip(override, MAX_TAG_VAL_LENGTH))


def point_champion_alias(client: MlflowClient, run_name: str, champion: str | None) -> None:
    """Point the `champion` alias at version `champion` (None: no alias, no round promoted yet)."""
    name = registered_model_name(run_name)
    if champion is not None:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, champion)
    elif CHAMPION_ALIAS in client.get_registered_model(name).aliases:
        client.delete_registered_model_alias(name, CHAMPION_ALIAS)
