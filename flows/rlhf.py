"""The RLHF flow: rounds of (SFT) -> (online labels) -> reward model -> RL (or DPO) -> evaluation ->
promotion, tracked in MLflow; one round's stages are flows/wiring.py's."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import yaml
from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.runtime import flow_run
from prefect.states import Crashed

from rlflow.engine.storage.lock import RunLock
from rlflow.engine.config.schema import Config, build_config
from rlflow.engine.config.secrets import merge_trees, redacted_dict, shown_url
from rlflow.flows.plan import read_run_file
from rlflow.flows.compare import format_cell
from rlflow.flows.promotion import Promotion, answer_rejection, settle_promotion
from rlflow.flows.report import build_report
from rlflow.flows.rounds import TaskRunner, lineage_tags
from rlflow.flows.wiring import RoundOutputs, run_rounds, summary_row
from rlflow.tasks.tracking import RunTracker, register_policy, registered_model_name, resolve_tracking_uri
from rlflow.engine.config.secrets import SECRETS_ENV

SUMMARY_KEYS = (
    "rm_accuracy",
    "gold_score_before",
    "gold_score_after",
    "gold_score_stderr",
    "kl",
    "response_length",
    "distinct_2",
    "valid_fraction",
    "seconds",
)


def write_run_file(config: Config, name: str, text: str) -> str:
    """A small file at the top of the run (summary.json, config.yaml); returns its URL."""
    url = f"{config.run.root.rstrip('/')}/{config.run.name}/{name}"
    with fsspec.open(url, "w", **config.run.storage_options) as f:
        f.write(text)
    return url


def write_summary(config: Config, rows: list[dict[str, Any]]) -> str:
    return write_run_file(config, "summary.json", json.dumps({"run": config.run.name, "rounds": rows}, indent=2))


def format_table(rows: list[dict[str, Any]]) -> str:
    promoted = any("promotion" in row for row in rows)  # promotion.enabled: each round's decision
    header = ["round", *SUMMARY_KEYS] + (["promotion"] if promoted else [])
    lines = ["  ".join(f"{h:>17}" for h in header)]
    for row in rows:
        cells = {**row, "promotion": (row.get("promotion") or {}).get("decision")}
        lines.append("  ".join(f"{format_cell(cells.get(h), h):>17}" for h in header))
    return "\n".join(lines)


def mark_stale_flow_runs_crashed(run_name: str) -> list[str]:
    """Other flow runs of this run name still "Running" belong to a killed process (we hold the
    run lock, so none can be alive): mark them Crashed so the Prefect UI tells the truth."""
    current = flow_run.get_id()
    # Paused too: a run paused for an operator (flows/breach.py) whose process was killed meanwhile.
    state_filter = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PAUSED]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name]), state=state_filter)
        )
        stale = [r for r in runs if str(r.id) != str(current)]
        for run in stale:
            client.set_flow_run_state(
                run.id, Crashed(message="process killed; continued by a later flow run"), force=True
            )
    return [str(r.id) for r in stale]




@flow(name="rlhf", flow_run_name="{config[run][name]}", result_serializer="json")  # never pickle
def rlhf_flow(config: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Run (or continue) `run.name`. `config` is the config tree with secret values redacted (it
    is stored by Prefect as the flow run's parameters); the secret values come from the
    environment variable RLFLOW_SECRETS, so no secret is ever stored in Prefect."""
    return run_pipeline(config, json.loads(os.environ.get(SECRETS_ENV) or "{}"), source)


@dataclass(frozen=True)
class OpenRun:
    """A run being run: its config (the tracking URI settled), its MLflow tracker and parent run."""

    config: Config
    tracker: RunTracker
    parent_run_id: str
    logger: Any


@contextlib.contextmanager
def opened_run(config: dict[str, Any], secret_tree: dict[str, Any], source: str) -> Iterator[OpenRun]:
    """Hold the run (its lock, first: a second process on this run must not touch its MLflow runs),
    settle its MLflow store and parent run, and keep config.yaml for `rlflow status`; afterwards
    finish the parent run (FAILED or KILLED when the rounds raised) and publish the report."""
    cfg = build_config(merge_trees(config, secret_tree), source)
    logger = get_run_logger()
    with RunLock(f"{cfg.run.root.rstrip('/')}/{cfg.run.name}", cfg.run.storage_options):
        for stale in mark_stale_flow_runs_crashed(cfg.run.name):
            logger.warning(
                "flow run %s of '%s' was left Running or Paused by a killed process: Crashed", stale, cfg.run.name
            )
        uri = settle_tracking_uri(cfg, logger)
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"uri": uri})})
        public = redacted_dict(cfg)  # what is stored from here on (config.yaml, MLflow params): from cfg alone
        write_run_file(cfg, "config.yaml", yaml.safe_dump(public, sort_keys=False))  # for `rlflow status`
        tracker = RunTracker(uri, cfg.tracking.experiment)
        parent = settle_parent_run(cfg, tracker, public, logger)
        tracker.mark_crashed_children(parent)
        try:
            yield OpenRun(cfg, tracker, parent, logger)
        except BaseException as exc:
            tracker.finish(parent, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        publish_report(cfg, tracker, parent, logger)
        tracker.finish(parent, "FINISHED")


def run_pipeline(config: dict[str, Any], secret_tree: dict[str, Any], source: str) -> dict[str, Any]:
    """The body of every flow that runs rounds (`config` redacted, `secret_tree` its secret values):
    all rounds in order, each starting from the champion (the last one's policy, or with promotion
    on, the last promoted one's); summary.json after each, and the round's policy registered in the
    MLflow model registry. Returns the rows and the champion's URI."""
    with opened_run(config, secret_tree, source) as run:
        cfg, tracker, logger = run.config, run.tracker, run.logger
        planner = TaskRunner(cfg, run.parent_run_id)
        rows: list[dict[str, Any]] = []
        champion: str | None = None  # the registered version promoted last

        def promote(r: int, outputs: RoundOutputs, seconds: float) -> bool:
            """Record round r (summary row, registered version), then the promotion gates' decision."""
            nonlocal champion
            row = summary_row(r, outputs.rm, outputs.evaluation) | {"seconds": round(seconds, 1)}
            rows.append(row)
            version = register_round(run, planner, r, outputs)
            promoted = True
            if cfg.promotion.enabled:
                outcome = decide_round(run, r, row, version, champion, rows)
                champion, promoted = outcome.champion_version, outcome.decision.promoted
            url = write_summary(cfg, rows)
            logger.info("round %d done: gold %.3f -> %.3f (summary: %s)", r, row["gold_score_before"],
                        row["gold_score_after"], url)
            return promoted

        policy = run_rounds(cfg, planner, promote)
        summary = json.dumps({"run": cfg.run.name, "rounds": rows}, indent=2)
        tracker.sink(run.parent_run_id).log_text("summary.json", summary)
    final_policy = policy if isinstance(policy, str) else policy.checkpoint_uri
    return {"run": cfg.run.name, "rounds": rows, "final_policy": final_policy}


def register_round(run: OpenRun, planner: TaskRunner, r: int, outputs: RoundOutputs) -> str:
    """The round's policy as a version of the run's registered model, with its lineage; its version."""
    cfg = run.config
    tags = lineage_tags(cfg, planner, run.parent_run_id, outputs.final, outputs.rm)
    version = register_policy(run.tracker.client, cfg.run.name, r, outputs.final.mlflow_run_id, tags)
    run.logger.info("round %d policy: version %s of MLflow model '%s'", r, version, registered_model_name(cfg.run.name))
    return version


def decide_round(run: OpenRun, r: int, row: dict[str, Any], version: str, champion: str | None,
                 rows: list[dict[str, Any]]) -> Promotion:
    """The promotion gates' decision on round r (an operator's answer to a rejection included),
    recorded in its summary row."""
    cfg = run.config

    def settle() -> Promotion:
        return settle_promotion(cfg, run.tracker, run.parent_run_id, r, row, version, champion, run.logger)

    outcome = settle()
    row["promotion"] = outcome.decision.as_row(outcome.champion_version)
    write_summary(cfg, rows)  # the rejection on record before the run stops or pauses
    outcome = answer_rejection(cfg, r, version, outcome, settle)
    row["promotion"] = outcome.decision.as_row(outcome.champion_version)
    return outcome


TRACKING_FILE = "tracking_uri"


def settle_tracking_uri(cfg: Config, logger: Any) -> str:
    """The MLflow store of the run: where it started, recorded in the run's folder. A continued
    run stays there, even if MLFLOW_TRACKING_URI now names another store (`make up` since), or
    its rounds would split over two stores; an explicit tracking.uri wins, with a warning. A URI
    holding credentials is not recorded (it would be a secret in a plain file)."""
    resolved = resolve_tracking_uri(cfg.tracking.uri, cfg.run.root)
    text = read_run_file(cfg.run.root, cfg.run.name, TRACKING_FILE, cfg.run.storage_options)
    recorded = text.strip() if text else None
    if recorded is None or recorded == resolved:
        if recorded is None and shown_url(resolved) == resolved:
            write_run_file(cfg, TRACKING_FILE, resolved)
        return resolved
    if cfg.tracking.uri is None:
        logger.warning(
            "run '%s' keeps its MLflow store %s (where it started), not %s", cfg.run.name, recorded, shown_url(resolved)
        )
        return recorded
    logger.warning(
        "tracking.uri %s is not the store run '%s' started in (%s): its earlier rounds are not there",
        shown_url(resolved),
        cfg.run.name,
        recorded,
    )
    return resolved


PARENT_FILE = "mlflow_parent_run"


def settle_parent_run(cfg: Config, tracker: RunTracker, public: dict[str, Any], logger: Any) -> str:
    """The run's parent MLflow run: the one its folder recorded. A folder without the record
    whose rounds exist (a run begun before runs recorded it) re-attaches by run name; a fresh
    folder (e.g. `runs/<name>` deleted) gets a new parent run, so MLflow never shows a new run
    under an old one's params, and the old run stays as it was."""
    text = read_run_file(cfg.run.root, cfg.run.name, PARENT_FILE, cfg.run.storage_options)
    recorded = text.strip() if text else None
    fs, path = fsspec.core.url_to_fs(f"{cfg.run.root.rstrip('/')}/{cfg.run.name}", **cfg.run.storage_options)
    begun = text is None and fs.exists(f"{path}/round_0")  # an empty record (a torn write) is no legacy run
    record = lambda run_id: write_run_file(cfg, PARENT_FILE, run_id + "\n")  # noqa: E731
    parent = tracker.parent_run(cfg.run.name, public, known_id=recorded, by_name=begun, record=record)
    if recorded is not None and parent != recorded:
        logger.warning(
            "run '%s' recorded MLflow run %s, which %s does not have (deleted, or another store): its rounds"
            " go to a new parent run %s",
            cfg.run.name,
            recorded,
            shown_url(tracker.tracking_uri),
            parent,
        )
    return parent


def publish_report(cfg: Config, tracker: RunTracker, parent: str, logger: Any) -> None:
    """report.html (and the figure) next to the checkpoints and in the parent MLflow run. The
    rounds are done and committed by now: a report that fails is a warning, not a failed run."""
    try:
        report, png = build_report(tracker.client, cfg)
        url = write_run_file(cfg, "report.html", report)
        tracker.log_bytes(parent, "report.html", report.encode())
        tracker.log_bytes(parent, "curves.png", png)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.warning("the run's HTML report could not be written: %s: %s", exc.__class__.__name__, exc)
        return
    logger.info("report: %s (and report.html in the run's MLflow artifacts)", url)


