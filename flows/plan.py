"""What a continued run will do, per stage, without loading a model: `rlflow run --dry-run` and
`rlflow status` print it. The round's stages and their identities come from flows/wiring.py, as the
flow's do; `StoreReader` tells, instead of running each stage, how far its store got: done, changed
(the keys that differ), at a committed step, or not started."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import fsspec
import yaml

from rlflow.engine.config.schema import Config, build_config
from rlflow.engine.config.secrets import REDACTED
from rlflow.engine.errors import ConfigError
from rlflow.engine.promotion.gates import decide_promotion
from rlflow.engine.stages.context import Record, StageOutcome
from rlflow.engine.stages.identity import IDENTITY_FORMAT, changed_keys
from rlflow.engine.stages.inputs import Upstream
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error
from rlflow.engine.telemetry.progress import events_path
from rlflow.flows.wiring import PENDING, PlannedStage, RoundOutputs, RoundPlanner, run_rounds, summary_row

OVERRIDES_FILE = "promotion_overrides.json"  # at the top of the run: {"rounds": {"<N>": {by, reason, at}}}


@dataclass(frozen=True)
class StageState:
    """One line of the plan."""

    round_index: int
    stage: str  # "sft" | "label" | "rm" | "rl" | "dpo" | "eval"
    steps: str  # what bounds the stage: "600 steps (max)", "2 epochs", "512 prompts"
    prefix: str  # where its checkpoints go
    state: str  # "done at step 30", "changed: rl.actor_lr; ...", "at step 20 (continues)", "not started"


def stage_bounds(c: Config, stage: str) -> str:
    if stage == "sft":
        return f"{c.sft.max_steps} steps (max; early stop after {c.sft.patience} flat evals)"
    if stage == "label":
        return f"{c.label.prompts_per_round} prompts, 2 answers each"
    if stage == "rm":
        return f"{c.rm.epochs} epochs"
    if stage == "dpo":
        return f"{c.dpo.epochs} epochs, beta {c.dpo.beta}"
    if stage == "rl":
        stop = f"; stops at KL {c.kl.stop_above}" if c.kl.stop_above else ""
        n = f" x {c.rollout.n} samples" if c.rollout.n > 1 else ""
        return f"{c.rl.steps} steps x {c.rl.rollout_batch} prompts{n} ({c.algorithm.name}){stop}"
    return f"{c.eval.num_prompts} prompts"


class StoreReader(RoundPlanner):
    """The plan's stages: what `rlflow run` would do with each, read from its store. A stage that has
    still to run passes a pending output on (its manifest is not known yet)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.lines: list[StageState] = []
        self.stopped_at: str | None = None

    def stage(self, stage: str, round_index: int, upstream: Record) -> StageOutcome:
        c, planned = self.config, self.planned(stage, round_index, upstream)
        prefix = stage_prefix(c.run.root, c.run.name or "<new name>", planned.round_index, planned.stage)
        state, outcome = self._read(planned, upstream, prefix)
        self.lines.append(StageState(planned.round_index, planned.stage, stage_bounds(c, planned.stage), prefix, state))
        return outcome

    def _read(self, planned: PlannedStage, upstream: Record, prefix: str) -> tuple[str, StageOutcome]:
        pending = StageOutcome(
            stage=planned.stage, round_index=planned.round_index, step=0, checkpoint_uri=prefix,
            manifest_sha256=PENDING + planned.identity, metrics={},
        )
        if self.stopped_at is not None:
            return f"not reached ({self.stopped_at} stops the run)", pending
        store = CheckpointStore(prefix, self.config.run.storage_options)
        final, newest = _read_store(store, prefix, self.config.run.storage_options)
        waits = _pending_inputs(upstream)
        if final is None and newest is None:
            return "not started" + (f" (after {', '.join(waits)})" if waits else ""), pending
        recorded = final if final is not None else store.manifest(newest)["meta"]
        at = f"done at step {final['step']}" if final is not None else f"at step {newest}"
        kept = pending if final is None else _finished(planned, store, final)
        if recorded.get("identity") == planned.identity:
            return (at, kept) if final is not None else (f"{at} (committed; continues)", kept)
        tree, where = recorded.get("identity_tree", {}), f"round {planned.round_index} {planned.stage}"
        if tree.get("format") != IDENTITY_FORMAT:
            self.stopped_at = where
            return f"{at}, written by rlflow 0.1: `rlflow run` refuses to continue it (use a new run.name)", pending
        keys = ", ".join(changed_keys(tree, planned.identity_tree))
        if waits:
            keys += f" (the input{'s' if len(waits) > 1 else ''} {', '.join(waits)} will be new)"
        if self.config.resume.allow_config_change:
            how = "its output is kept" if final is not None else "it continues from that step"
            return f"{at}, changed: {keys}; {how} (resume.allow_config_change)", kept
        self.stopped_at = where
        stop = "`rlflow run` stops here: a new run.name runs it again, resume.allow_config_change=true keeps it"
        return f"{at}, changed: {keys}; {stop}", pending


def _finished(planned: PlannedStage, store: CheckpointStore, final: dict[str, Any]) -> StageOutcome:
    """A finished stage's outcome, as its final.json records it."""
    return StageOutcome(
        stage=planned.stage, round_index=planned.round_index, step=final["step"],
        checkpoint_uri=store.step_url(final["step"]), manifest_sha256=final["manifest_sha256"],
        metrics=final.get("metrics", {}),
    )


def _read_store(store: CheckpointStore, prefix: str, storage_options: dict[str, Any]) -> tuple[dict | None, int | None]:
    """(final.json or None, the newest committed step or None); an unreadable store is a ConfigError."""
    try:
        final = store.final()
        return final, None if final is not None else store.latest()
    except STORAGE_ERRORS as exc:
        reason = describe_storage_error(prefix, exc, storage_options, "run.storage_options")
        root = prefix.rsplit("/round_", 1)[0].rsplit("/", 1)[0]
        raise ConfigError(f"run.root {root!r} cannot be read: {reason}") from None


def _pending_inputs(upstream: Record) -> list[str]:
    """The upstream inputs that do not exist yet (a stage before this one has still to run)."""
    names = []
    for name, value in upstream:
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, Upstream) and v.identity.startswith(PENDING) for v in values):
            names.append(name)
    return names


def plan_run(config: Config) -> list[StageState]:
    """Every stage the flow will run, in order, and what it will do with it: the flow's own rounds
    (flows/wiring.py), each round starting from the policy the promotion gates chose (decided again
    from the round's recorded evaluation, as a continued run decides it)."""
    reader = StoreReader(config)
    promoted_by_hand = read_overrides(config) if config.run.name else {}

    def promote(r: int, outputs: RoundOutputs, seconds: float) -> bool:
        if not config.promotion.enabled or outputs.evaluation.manifest_sha256.startswith(PENDING):
            return True
        row = summary_row(r, outputs.rm, outputs.evaluation)
        return decide_promotion(row, config.promotion.gates, promoted_by_hand.get(r)).promoted

    run_rounds(config, reader, promote)
    return reader.lines


def format_plan(planned: list[StageState]) -> str:
    width = max((len(p.steps) for p in planned), default=10)
    lines = []
    for p in planned:
        lines.append(f"  round {p.round_index}  {p.stage:5}  {p.steps:<{width}}  -> {p.prefix}  [{p.state}]")
    return "\n".join(lines)


def read_overrides(cfg: Config) -> dict[int, str]:
    """Rounds promoted by hand (`rlflow promote`): round -> "<who>: <why>"."""
    text = read_run_file(cfg.run.root, cfg.run.name, OVERRIDES_FILE, cfg.run.storage_options)
    rounds = json.loads(text)["rounds"] if text else {}
    return {int(r): f"{o['by']}: {o['reason']}" for r, o in rounds.items()}


def read_run_file(root: str, run_name: str, name: str, storage_options: dict[str, Any]) -> str | None:
    """A file the flow keeps at the top of a run (config.yaml, summary.json); None if absent."""
    url = f"{root.rstrip('/')}/{run_name}/{name}"
    try:
        with fsspec.open(url, "r", **storage_options) as f:
            return f.read()
    except FileNotFoundError:
        return None


def last_events(root: str, run_name: str, n: int = 1) -> list[dict[str, Any]]:
    """The last `n` step events of events.jsonl (torn lines skipped)."""
    path = events_path(root, run_name)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines()[-(n + 5) :]:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events[-n:]


def load_run_config(root: str, run_name: str) -> Config:
    """The config a run was last started with (`<root>/<run>/config.yaml`, written redacted by
    the flow). A redacted value falls back to its default: storage credentials then come from
    the environment (AWS_* for s3fs), as they would for `rlflow run` without them."""
    text = read_run_file(root, run_name, "config.yaml", {})
    if text is None:
        raise ConfigError(f"no run '{run_name}' under {root} (no config.yaml there); check the name and --root")
    return build_config(_without_redacted(yaml.safe_load(text)), f"{root.rstrip('/')}/{run_name}/config.yaml")


def _without_redacted(tree: Any) -> Any:
    if not isinstance(tree, dict):
        return tree
    return {k: _without_redacted(v) for k, v in tree.items() if v != REDACTED}
