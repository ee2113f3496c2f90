"""The plan of a run (rounds x stages, where each writes, how far each got) without loading a
model: `rlflow run --dry-run` and `rlflow status` print it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import fsspec
import yaml

from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.schema import Config, build_config
from rlflow.engine.errors import ConfigError
from rlflow.engine.telemetry.progress import events_path
from rlflow.engine.config.secrets import REDACTED


@dataclass(frozen=True)
class PlannedStage:
    round_index: int
    stage: str  # "sft" | "label" | "rm" | "ppo" | "dpo" | "eval"
    steps: str  # what bounds the stage: "600 steps (max)", "2 epochs", "512 prompts"
    prefix: str  # where its checkpoints go
    state: str = ""  # "done at step 30", "at step 20", "not started" (filled by `with_progress`)


def plan_stages(config: Config) -> list[PlannedStage]:
    """Every stage the flow will run, in order (the flow's own rules: SFT only in sft.rounds,
    online labels from label.online_from_round)."""
    c, planned = config, []
    online = c.label.online_from_round
    for r in range(c.run.rounds):
        stages = []
        if r in c.sft.rounds:
            stages.append(("sft", f"{c.sft.max_steps} steps (max; early stop after {c.sft.patience} flat evals)"))
        dpo = c.algorithm.name == "dpo"
        if online is not None and r >= online and (dpo or c.reward.learned):
            stages.append(("label", f"{c.label.prompts_per_round} prompts, 2 answers each"))
        if dpo:
            stages.append(("dpo", f"{c.dpo.epochs} epochs, beta {c.dpo.beta}"))
        else:
            if c.reward.learned:
                stages.append(("rm", f"{c.rm.epochs} epochs"))
            stop = f"; stops at KL {c.kl.stop_above}" if c.kl.stop_above else ""
            n = f" x {c.rollout.n} samples" if c.rollout.n > 1 else ""
            what = f"{c.ppo.steps} steps x {c.ppo.rollout_batch} prompts{n} ({c.algorithm.name}){stop}"
            stages.append(("ppo", what))
        stages.append(("eval", f"{c.eval.num_prompts} prompts"))
        for stage, steps in stages:
            prefix = stage_prefix(c.run.root, c.run.name or "<new name>", r, stage)
            planned.append(PlannedStage(r, stage, steps, prefix))
    return planned


def with_progress(planned: list[PlannedStage], storage_options: dict[str, Any]) -> list[PlannedStage]:
    """Each stage's state read from its checkpoint store (a final marker, the last committed step).
    A store that cannot be read (no credentials, a missing bucket) is a ConfigError naming run.root."""
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error

    out = []
    for p in planned:
        store = CheckpointStore(p.prefix, storage_options)
        try:
            final = store.final()
            latest = None if final is not None else store.latest()
        except STORAGE_ERRORS as exc:
            reason = describe_storage_error(p.prefix, exc, storage_options, "run.storage_options")
            root = p.prefix.rsplit("/round_", 1)[0].rsplit("/", 1)[0]
            raise ConfigError(f"run.root {root!r} cannot be read: {reason}") from None
        if final is not None:
            state = f"done at step {final['step']}"
        else:
            state = "not started" if latest is None else f"at step {latest} (committed)"
        out.append(PlannedStage(p.round_index, p.stage, p.steps, p.prefix, state))
    return out


def format_plan(planned: list[PlannedStage]) -> str:
    width = max((len(p.steps) for p in planned), default=10)
    lines = []
    for p in planned:
        state = f"  [{p.state}]" if p.state else ""
        lines.append(f"  round {p.round_index}  {p.stage:5}  {p.steps:<{width}}  -> {p.prefix}{state}")
    return "\n".join(lines)


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
