"""The RLHF flow: rounds of (SFT) -> (online labels) -> reward model -> PPO -> evaluation.

Each stage's output checkpoint URI is passed explicitly to the next stage; each stage's identity
is computed here from its config subtree, its inputs' manifest hashes and its data fingerprints.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import fsspec
from fsspec.core import url_to_fs
import yaml
from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.runtime import flow_run
from prefect.states import Crashed

from rlflow.engine.run_lock import RunLock
from rlflow.engine.config import Config, build_config
from rlflow.engine.secrets import merge_trees, redact, shown_url
from rlflow.flows.plan import read_run_file
from rlflow.engine.data import fingerprint_file
from rlflow.engine.models import model_fingerprint
from rlflow.engine.round_stages import PAIRS_FILE
from rlflow.engine.stage import compute_identity
from rlflow.flows.breach import settle_breaches
from rlflow.flows.compare import format_cell
from rlflow.flows.report import build_report
from rlflow.tasks.stages import (
    StageResult,
    StageSpec,
    eval_task,
    label_task,
    output_exists,
    ppo_task,
    retryable,
    rm_task,
    sft_task,
)
from rlflow.tasks.tracking import RunTracker, register_policy, registered_model_name, resolve_tracking_uri

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


class RoundPlanner:
    """Builds each stage's spec (identity) from the config and the upstream results."""

    def __init__(self, config: Config, parent_run_id: str):
        self.config, self.parent_run_id = config, parent_run_id
        data = config.data
        self.fingerprints = {
            name: fingerprint_file(getattr(data, name), data.storage_options)
            for name in ("sft", "sft_eval", "preferences", "preferences_eval", "prompts", "eval_prompts")
        }

    def spec(
        self, stage: str, round_index: int, sections: dict[str, Any], inputs: dict[str, str], data: tuple[str, ...]
    ) -> StageSpec:
        items = sections.items()
        tree = {
            "stage": stage,
            "seed": self.config.run.seed,
            # Redacted: the tree is stored in every manifest, and a credential (a judge's api_key)
            # rotating must not make a finished stage "changed".
            "config": redact({k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in items}),
            "inputs": inputs,
            "data": {name: self.fingerprints[name] for name in data},
        }
        if stage in ("label", "ppo", "eval"):  # the stages that encode prompts
            tree["data_options"] = {k: getattr(self.config.data, k) for k in ("max_prompt_tokens", "prompt_overflow")}
        return StageSpec(
            stage=stage,
            round_index=round_index,
            identity=compute_identity(tree),
            identity_tree=tree,
            parent_run_id=self.parent_run_id,
        )


def run_stage(task_fn: Any, config: Config, spec: StageSpec, *args: Any) -> StageResult:
    """Call a stage task with its retry policy (stage.retries; each retry resumes from the last
    checkpoint); a cached result whose checkpoint is gone (deleted or pruned by hand) is not
    trusted: the task runs again with the cache refreshed. A breach (never cached) is returned
    as it is: the caller settles it (flows/breach.py)."""
    policy = config.stage.policy(spec.stage)
    task_fn = task_fn.with_options(
        retries=policy.retries, retry_delay_seconds=policy.retry_delay_s, retry_condition_fn=retryable
    )
    result = task_fn(config, spec, *args)
    if result.breach is None and not output_exists(config, result):
        result = task_fn.with_options(refresh_cache=True)(config, spec, *args)
    return result


def _input_id(value: str | StageResult) -> str:
    return value.manifest_sha256 if isinstance(value, StageResult) else model_fingerprint(value)


def _uri(value: str | StageResult) -> str:
    return value.checkpoint_uri if isinstance(value, StageResult) else value


def run_round(
    config: Config,
    planner: RoundPlanner,
    r: int,
    policy: str | StageResult,
    sft: str | StageResult,
    labels: list[StageResult],
) -> tuple[StageResult, StageResult | str, StageResult, dict[str, Any]]:
    """One round; returns (final policy, SFT policy, reward model, summary row). `labels` grows
    by this round's."""
    c = config
    model_section = c.model.model_dump(exclude={"path"})
    if r in c.sft.rounds:
        spec = planner.spec(
            "sft",
            r,
            {"sft": c.sft.model_dump(exclude={"rounds", "log_every"}), "model": model_section},
            {"init": _input_id(policy)},
            ("sft", "sft_eval"),
        )
        sft = policy = run_stage(sft_task, c, spec, _uri(policy))
    if c.label.online_from_round is not None and r >= c.label.online_from_round:
        spec = planner.spec(
            "label",
            r,
            {"label": c.label.model_dump(exclude={"human_inbox"}), "ppo_sampling": _sampling(c)},
            {"policy": _input_id(policy)},
            ("prompts",),
        )
        labels.append(run_stage(label_task, c, spec, _uri(policy)))  # the reward model trains on the union
    rm_init = sft if c.rm.init == "sft" else c.rm.init
    human = human_label_files(c, r)
    rm_inputs = {"init": _input_id(rm_init), "labels": ",".join(l.manifest_sha256 for l in labels)}
    if human:  # only then: runs without human labels keep their identities
        # Names and hashes, not URLs: a moved project or another mount is not a change.
        rm_inputs["human"] = ",".join(f"{url.rsplit('/', 1)[-1]}@{fp}" for url, fp in human.items())
    rm_spec = planner.spec(
        "rm",
        r,
        {"rm": c.rm.model_dump(exclude={"log_every"}), "model": model_section},
        rm_inputs,
        ("preferences", "preferences_eval", "sft"),
    )
    online = [f"{l.checkpoint_uri}/{PAIRS_FILE}" for l in labels if l.metrics.get("label/pairs", 0) > 0]
    rm = run_stage(rm_task, c, rm_spec, _uri(rm_init), online + list(human))
    reference = sft if c.ppo.reference == "sft" else policy
    inputs = {"policy": _uri(policy), "reference": _uri(reference), "sft": _uri(sft)}
    ppo_spec = planner.spec(
        "ppo",
        r,
        {
            "ppo": c.ppo.model_dump(exclude={"log_every"}),
            "eval": c.eval,
            "gold": c.gold,
            "keep_best": [c.checkpoint.keep_best, c.checkpoint.keep_best_mode],
            "model": model_section,
        },
        {k: _input_id(v) for k, v in (("policy", policy), ("reference", reference), ("sft", sft), ("rm", rm))},
        ("prompts", "eval_prompts"),
    )
    ppo = run_stage(ppo_task, c, ppo_spec, inputs, rm)
    ppo = settle_breaches(c, ppo, lambda overrides: run_stage(ppo_task, c, ppo_spec, inputs, rm, overrides))
    eval_spec = planner.spec(
        "eval",
        r,
        {"eval": c.eval, "gold": c.gold, "sampling": _sampling(c), "model": model_section},
        {
            k: _input_id(v)
            for k, v in (("policy", policy), ("final", ppo), ("reference", reference), ("sft", sft), ("rm", rm))
        },
        ("eval_prompts",),
    )
    evaluation = run_stage(eval_task, c, eval_spec, inputs | {"final": ppo.checkpoint_uri}, rm)
    return ppo, sft, rm, _summary_row(r, rm, evaluation)


def human_label_files(config: Config, round_index: int) -> dict[str, str]:
    """{url: sha256} of the human label files (`rlflow label import`) of rounds before this one."""
    inbox = config.label.human_inbox
    if inbox is None:
        return {}
    fs, base = url_to_fs(f"{inbox.rstrip('/')}/{config.run.name}", **config.data.storage_options)
    found = {}
    for path in sorted(fs.glob(f"{base}/round_*.jsonl")):
        match = re.fullmatch(r"round_(\d+)\.jsonl", path.rsplit("/", 1)[-1])
        if match and int(match[1]) < round_index:
            url = fs.unstrip_protocol(path) if "://" in inbox else path
            found[url] = fingerprint_file(url, config.data.storage_options)
    return found


def _sampling(c: Config) -> dict[str, Any]:
    return {"temperature": c.ppo.temperature, "top_p": c.ppo.top_p, "max_new_tokens": c.ppo.max_new_tokens}


def _summary_row(r: int, rm: StageResult, evaluation: StageResult) -> dict[str, Any]:
    m = evaluation.metrics
    return {
        "round": r,
        "rm_accuracy": rm.metrics.get("rm/accuracy"),
        "gold_score_before": m["gold_score_before"],
        "gold_score_after": m["gold_score_after"],
        "gold_score_stderr": m["gold_score_stderr_after"],
        "kl": m["kl_after"],
        "response_length": m["response_length_after"],
        "distinct_2": m["distinct_2_after"],
        "valid_fraction": m["valid_fraction_after"],
        "response_length_before": m["response_length_before"],
        "distinct_2_before": m["distinct_2_before"],
        "valid_fraction_before": m["valid_fraction_before"],
    }


def lineage_tags(planner: RoundPlanner, policy: StageResult, rm: StageResult) -> dict[str, str]:
    """What a registered policy came from: its checkpoint, runs, reward model and data."""
    tags = {
        "rlflow.checkpoint_uri": policy.checkpoint_uri,
        "rlflow.manifest_sha256": policy.manifest_sha256,
        "rlflow.parent_run_id": planner.parent_run_id,
        "rlflow.ppo_run_id": policy.mlflow_run_id or "",
        "rlflow.reward_model_run_id": rm.mlflow_run_id or "",
        "rlflow.reward_model_uri": rm.checkpoint_uri,
        "rlflow.run_name": planner.config.run.name,
    }
    return tags | {f"rlflow.data.{name}": fp for name, fp in planner.fingerprints.items()}


def write_run_file(config: Config, name: str, text: str) -> str:
    """A small file at the top of the run (summary.json, config.yaml); returns its URL."""
    url = f"{config.run.root.rstrip('/')}/{config.run.name}/{name}"
    with fsspec.open(url, "w", **config.run.storage_options) as f:
        f.write(text)
    return url


def write_summary(config: Config, rows: list[dict[str, Any]]) -> str:
    return write_run_file(config, "summary.json", json.dumps({"run": config.run.name, "rounds": rows}, indent=2))


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["round", *SUMMARY_KEYS]
    lines = ["  ".join(f"{h:>17}" for h in header)]
    for row in rows:
        lines.append("  ".join(f"{format_cell(row.get(h), h):>17}" for h in header))
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


SECRETS_ENV = "RLFLOW_SECRETS"  # JSON tree of the redacted config values; never a flow parameter


@flow(name="rlhf", flow_run_name="{config[run][name]}", result_serializer="json")  # never pickle
def rlhf_flow(config: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Run (or continue) `run.name`. `config` is the config tree with secret values redacted (it
    is stored by Prefect as the flow run's parameters); the secret values come from the
    environment variable RLFLOW_SECRETS, so no secret is ever stored in Prefect."""
    return run_pipeline(config, json.loads(os.environ.get(SECRETS_ENV) or "{}"), source)


def run_pipeline(config: dict[str, Any], secret_tree: dict[str, Any], source: str) -> dict[str, Any]:
    """The body of every flow that runs rounds: `config` redacted, `secret_tree` its secret values."""
    cfg = build_config(merge_trees(config, secret_tree), source)
    logger = get_run_logger()
    # The lock comes first: a second process on this run must not touch its MLflow runs.
    with RunLock(f"{cfg.run.root.rstrip('/')}/{cfg.run.name}", cfg.run.storage_options):
        for stale in mark_stale_flow_runs_crashed(cfg.run.name):
            logger.warning(
                "flow run %s of '%s' was left Running or Paused by a killed process: Crashed", stale, cfg.run.name
            )
        uri = settle_tracking_uri(cfg, logger)
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"uri": uri})})
        config = {**config, "tracking": {**config.get("tracking", {}), "uri": uri}}
        write_run_file(cfg, "config.yaml", yaml.safe_dump(config, sort_keys=False))  # redacted: for `rlflow status`
        tracker = RunTracker(uri, cfg.tracking.experiment)
        parent = tracker.parent_run(cfg.run.name, config)
        tracker.mark_crashed_children(parent)
        try:
            rows, policy = run_rounds(cfg, parent, logger, tracker)
        except BaseException as exc:
            tracker.finish(parent, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        tracker.sink(parent).log_text("summary.json", json.dumps({"run": cfg.run.name, "rounds": rows}, indent=2))
        publish_report(cfg, tracker, parent, logger)
        tracker.finish(parent, "FINISHED")
    return {"run": cfg.run.name, "rounds": rows, "final_policy": policy.checkpoint_uri}


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


def run_rounds(
    cfg: Config, parent_run_id: str, logger: Any, tracker: RunTracker
) -> tuple[list[dict[str, Any]], StageResult]:
    """All rounds in order, each starting from the last one's policy; summary.json after each,
    and the round's policy registered in the MLflow model registry."""
    planner = RoundPlanner(cfg, parent_run_id)
    policy: str | StageResult = cfg.model.path
    sft: str | StageResult = cfg.model.path
    labels: list[StageResult] = []
    rows: list[dict[str, Any]] = []
    for r in range(cfg.run.rounds):
        started = time.monotonic()
        policy, sft, rm, row = run_round(cfg, planner, r, policy, sft, labels)
        rows.append(row | {"seconds": round(time.monotonic() - started, 1)})
        version = register_policy(
            tracker.client, cfg.run.name, r, policy.mlflow_run_id, lineage_tags(planner, policy, rm)
        )
        logger.info("round %d policy: version %s of MLflow model '%s'", r, version, registered_model_name(cfg.run.name))
        url = write_summary(cfg, rows)
        logger.info(
            "round %d done: gold %.3f -> %.3f (summary: %s)", r, row["gold_score_before"], row["gold_score_after"], url
        )
    return rows, policy
