"""`rlflow compare RUN [RUN ...]`: rounds side by side, read back from MLflow.

A table of per-round numbers (gold and reward-model score, KL, reward-model accuracy, PPO
tokens/s, seconds, and what those seconds cost on the run's devices at configs/prices.yaml's
price) and a figure of reward, KL and response length per PPO step, one line per
(run, round), saved as a PNG and logged to each run's parent MLflow run under compare/.
With two runs or more, each later run's rounds are also paired with the first run's same round
on the same held-out prompts: the mean per-prompt difference of gold_after and its standard
error, which sees a change that two means' separate errors would hide.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlflow.configs import shipped_file
from rlflow.engine.errors import ConfigError

# (column, stage, metric): the eval child logs "before" at step 0 and "after" at step 1.
TABLE_COLUMNS = (
    ("gold_before", "eval", "eval/gold_score@0"),
    ("gold_after", "eval", "eval/gold_score"),
    ("rm_score", "eval", "eval/rm_score"),
    ("kl", "eval", "eval/kl"),
    ("rm_acc", "rm", "rm/accuracy"),
    ("rl_tok_s", "rl", "perf/throughput@mean"),
)
PRICES = shipped_file("prices.yaml")  # configs/prices.yaml, in the source tree or the installed wheel
CURVES = (("reward", "critic/score/mean"), ("KL", "actor/kl"), ("response length", "response_length/mean"))


@dataclass
class RoundRecord:
    run: str
    round_index: int
    values: dict[str, float] = field(default_factory=dict)  # TABLE_COLUMNS + seconds
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> (step, value)
    children: dict[str, str] = field(default_factory=dict)  # stage -> MLflow run id


def collect(client: Any, experiment: str, run_names: list[str]) -> tuple[dict[str, str], list[RoundRecord]]:
    """({run name: parent run id}, a RoundRecord per round of each run, in order)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ConfigError(f"MLflow experiment {experiment!r} not found at {client.tracking_uri}")
    parents, records = {}, []
    for name in run_names:
        if "'" in name:
            raise ConfigError(f"run name {name!r} cannot contain a quote")
        found = client.search_runs(
            [exp.experiment_id],
            f"tags.`rlflow.run_name` = '{name}' and tags.`rlflow.kind` = 'parent'",
            max_results=1,
            order_by=["attributes.start_time DESC"],  # a name started again in a fresh folder: its newest run
        )
        if not found:
            raise ConfigError(
                f"no run named {name!r} in MLflow experiment {experiment!r} at {client.tracking_uri};"
                " is MLFLOW_TRACKING_URI (or --tracking-uri) the store the run used?"
            )
        parents[name] = parent_id = found[0].info.run_id
        children = client.search_runs(
            [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000
        )
        by_round: dict[int, RoundRecord] = {}
        for child in children:
            r = int(child.data.tags["rlflow.round"])
            rec = by_round.setdefault(r, RoundRecord(name, r))
            stage = child.data.tags["rlflow.stage"]
            rec.children[stage] = child.info.run_id
            if child.info.end_time and child.info.start_time:
                rec.values["seconds"] = (
                    rec.values.get("seconds", 0.0) + (child.info.end_time - child.info.start_time) / 1e3
                )
        for rec in sorted(by_round.values(), key=lambda x: x.round_index):
            _fill(client, rec)
            records.append(rec)
    return parents, records


def _fill(client: Any, rec: RoundRecord) -> None:
    for column, stage, metric in TABLE_COLUMNS:
        run_id = rec.children.get(stage)
        if run_id is None:
            continue
        key, _, how = metric.partition("@")
        history = client.get_metric_history(run_id, key)
        if not history:
            continue
        if how == "mean":
            rec.values[column] = sum(m.value for m in history) / len(history)
        elif how:
            at = [m.value for m in history if m.step == int(how)]
            if at:
                rec.values[column] = at[0]
        else:
            rec.values[column] = max(history, key=lambda m: (m.step, m.timestamp)).value
    if "rl" in rec.children:
        for _, key in CURVES:
            history = client.get_metric_history(rec.children["rl"], key)
            rec.curves[key] = sorted({m.step: m.value for m in history}.items())


def price_rounds(client: Any, parents: dict[str, str], records: list[RoundRecord], book: Any) -> None:
    """Each round's "cost": its stages' wall seconds x the run's devices (resources.nproc_per_node x
    nnodes) x the hourly price of its device (resources.gpu_type, else this machine's CPU)."""
    from rlflow.engine.estimate.hardware import CPU_DEVICE

    rates = {}
    for name, parent_id in parents.items():
        params = client.get_run(parent_id).data.params
        # The parent run's params are the flattened config (tasks/tracking.py RunTracker.parent_run).
        device = params.get("resources.gpu_type") or CPU_DEVICE
        device = CPU_DEVICE if device == "None" else device
        if device not in book.devices:
            raise ConfigError(
                f"run {name!r} ran on resources.gpu_type={device!r}, which {book.source} does not price;"
                f" add it there or pass --prices (priced: {', '.join(sorted(book.devices))})"
            )
        count = int(params.get("resources.nproc_per_node", 1)) * int(params.get("resources.nnodes", 1))
        rates[name] = count * float(book.devices[device]["price_per_gpu_hour"]) / 3600
    for rec in records:
        if "seconds" in rec.values:
            rec.values["cost"] = rec.values["seconds"] * rates[rec.run]


def format_compare_table(records: list[RoundRecord], currency: str = "USD") -> str:
    columns = [c for c, _, _ in TABLE_COLUMNS] + ["seconds", "cost"]
    names = {"cost": f"cost_{currency}"}
    header = f"{'run':<24} {'round':>5} " + " ".join(f"{names.get(c, c):>11}" for c in columns)
    lines = [header]
    for rec in records:
        cells = " ".join(f"{format_cell(rec.values.get(c), c):>11}" for c in columns)
        lines.append(f"{rec.run[:24]:<24} {rec.round_index:>5} {cells}")
    return "\n".join(lines)


def format_cell(value: Any, column: str = "") -> str:
    """A table cell: floats to 4 decimals (seconds and tokens/s to 1), "-" for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if not isinstance(value, float):
        return str(value)
    if column == "cost":
        return f"{value:.4g}"
    return f"{value:.1f}" if column in ("seconds", "rl_tok_s") else f"{value:.4f}"


def load_gold_by_prompt(client: Any, rec: RoundRecord) -> tuple[list[str], list[float]] | None:
    """(prompt digests, gold_after per prompt) from the round's eval child; None where it has no
    per-prompt table (no eval stage, or a run recorded before the table existed)."""
    from rlflow.engine.stages.round_eval import BY_PROMPT_TABLE  # (torch: only when runs are paired)

    run_id = rec.children.get("eval")
    if run_id is None or not any(f.path == BY_PROMPT_TABLE for f in client.list_artifacts(run_id)):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        table = json.loads(Path(client.download_artifacts(run_id, BY_PROMPT_TABLE, tmp)).read_text())
    column = {name: i for i, name in enumerate(table["columns"])}
    rows = table["data"]
    return [r[column["prompt"]] for r in rows], [float(r[column["gold_after"]]) for r in rows]


ByPrompt = dict[tuple[str, int], tuple[list[str], list[float]] | None]  # (run, round) -> load_gold_by_prompt


def format_paired(records: list[RoundRecord], by_prompt: ByPrompt) -> list[str]:
    """Each round of the second and later runs against the first run's same round, per held-out
    prompt: the mean of (its gold_after - the first run's) and the standard error of that mean."""
    from rlflow.engine.algorithms.stats import paired_difference

    if not records:
        return []
    first = records[0].run
    header = f"{'gold_after paired with ' + first[:24]:<48} {'diff':>9} {'stderr':>9} {'prompts':>7}"
    lines = []
    for rec in records:
        if rec.run == first or (first, rec.round_index) not in by_prompt:
            continue
        label = f"{rec.run[:24]:<24} r{rec.round_index:<3}"
        mine, theirs = by_prompt[(rec.run, rec.round_index)], by_prompt[(first, rec.round_index)]
        if mine is None or theirs is None:
            lines.append(f"{label:<48} no per-prompt scores (an eval stage records them)")
        elif mine[0] != theirs[0]:
            lines.append(f"{label:<48} other held-out prompts than {first}'s: not paired")
        else:
            diff, stderr = paired_difference(theirs[1], mine[1])
            lines.append(f"{label:<48} {diff:>+9.4f} {stderr:>9.4f} {len(mine[0]):>7}")
    return [header] + lines if lines else []


def plot_curves(records: list[RoundRecord]) -> bytes:
    """A PNG: one panel per CURVES metric, one line per (run, round), x = PPO step."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6), dpi=90)
    for ax, (title, key) in zip(axes, CURVES):
        for rec in records:
            points = rec.curves.get(key) or []
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=f"{rec.run} r{rec.round_index}")
        ax.set_title(f"{title} ({key})", fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def command_compare(args: argparse.Namespace) -> int:
    from rlflow.tasks.tracking import RunTracker, resolve_tracking_uri

    tracker = RunTracker(resolve_tracking_uri(args.tracking_uri, args.root), args.experiment)
    client = tracker.client
    from rlflow.engine.estimate.hardware import load_price_book

    parents, records = collect(client, args.experiment, args.runs)
    book = load_price_book(args.prices)
    price_rounds(client, parents, records, book)
    print(format_compare_table(records, book.currency))
    if len(parents) > 1:
        by_prompt = {(r.run, r.round_index): load_gold_by_prompt(client, r) for r in records}
        for line in format_paired(records, by_prompt):
            print(line)
    png = plot_curves(records)
    out = Path(args.out or f"{args.root}/compare-{'-vs-'.join(args.runs)}.png")
    if "://" in str(out):
        raise ConfigError(f"--out {out}: a local file path is expected")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    artifact = f"compare/{out.name}"
    for parent_id in parents.values():
        tracker.log_bytes(parent_id, artifact, png)
    print(f"figure: {out} (also the MLflow artifact {artifact} of each run's parent run)")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="per-round table and reward/KL/length figure of runs, from MLflow")
    p.add_argument("runs", nargs="+", metavar="RUN_NAME")
    p.add_argument("--out", help="PNG path (default: <root>/compare-<runs>.png)")
    p.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else <root>/mlflow.db)")
    p.add_argument("--experiment", default="rlflow")
    p.add_argument("--root", default="runs", help="run.root of the runs (default: runs)")
    p.add_argument("--prices", default=str(PRICES), help="device prices for the cost column (configs/prices.yaml)")
    p.set_defaults(handler=command_compare)
