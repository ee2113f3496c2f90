"""An HTML report per run: the reward/KL/length figure, the per-round table, and a dozen sample
responses per round with their scores. One self-contained file (the figure inlined), written
next to the run's checkpoints and logged to its parent MLflow run as report.html."""

from __future__ import annotations

import base64
import html
import json
from typing import Any

from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.schema import Config
from rlflow.engine.data.conversations import prompt_text
from rlflow.engine.stages.round_eval import RESULTS_FILE
from rlflow.flows.plan import read_run_file
from rlflow.flows.compare import TABLE_COLUMNS, RoundRecord, format_cell, collect, plot_curves

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#1d2330;max-width:1400px}
h1{font-size:22px;margin-bottom:2px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #dde}
.meta{color:#667;font-size:13px} img{max-width:100%;border:1px solid #e3e5ee}
table{border-collapse:collapse;font-size:13px;margin:8px 0} th,td{padding:4px 10px;border-bottom:1px solid #e3e5ee}
th{background:#f3f4f8;text-align:left} td.n{text-align:right;font-variant-numeric:tabular-nums}
td.r{max-width:520px;font-family:ui-monospace,monospace;font-size:12px;white-space:pre-wrap}
"""


def sample_rows(config: Config, round_index: int, n: int = 12) -> list[dict[str, Any]]:
    """The round's evaluation samples of its final policy (prompt, response, gold and RM score)."""
    store = CheckpointStore(
        stage_prefix(config.run.root, config.run.name, round_index, "eval"), config.run.storage_options
    )
    final = store.final()
    if final is None:
        return []
    return store.read_json(final["step"], RESULTS_FILE)["after"]["samples"][:n]


def promotion_section(rows: list[dict[str, Any]]) -> list[str]:
    """The gate table of every round decided by the promotion gates (summary.json rows)."""
    parts = []
    for row in rows:
        promotion = row.get("promotion")
        if not promotion:
            continue
        champion = promotion.get("champion_version") or "none"
        verdict = promotion["decision"] + (f" by hand ({promotion['override']})" if promotion.get("override") else "")
        parts.append(f"<h2>Round {row['round']}: {html.escape(verdict)} (champion: version {champion})</h2>")
        parts.append("<table class=gates><tr><th>gate</th><th>value</th><th>min</th><th>max</th><th>result</th></tr>")
        for gate in promotion.get("gates", []):
            result = {True: "pass", False: "FAIL", None: "skipped"}[gate["passed"]]
            cells = "".join(f"<td class=n>{format_cell(gate[k])}</td>" for k in ("value", "min", "max"))
            parts.append(
                f"<tr><td>{html.escape(gate['metric'])}</td>{cells}"
                f"<td>{result}: {html.escape(gate['reason'])}</td></tr>"
            )
        parts.append("</table>")
    return parts


def render_report(
    run_name: str,
    records: list[RoundRecord],
    png: bytes,
    samples: dict[int, list[dict]],
    summary_rows: list[dict[str, Any]] | None = None,
) -> str:
    columns = [c for c, _, _ in TABLE_COLUMNS] + ["seconds"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["round", *columns])
    body = "".join(
        f"<tr><td class=n>{rec.round_index}</td>"
        + "".join(f"<td class=n>{format_cell(rec.values.get(c), c)}</td>" for c in columns)
        + "</tr>"
        for rec in records
    )
    parts = [
        f"<!doctype html><html><head><meta charset=utf-8><title>rlflow run {html.escape(run_name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>rlflow run <code>{html.escape(run_name)}</code></h1>",
        f"<div class=meta>{len(records)} round(s); numbers read back from MLflow</div>",
        "<h2>Rounds</h2>",
        f"<table id=rounds><tr>{head}</tr>{body}</table>",
        "<h2>Reward, KL and response length per PPO step</h2>",
        f"<img alt='curves' src='data:image/png;base64,{base64.b64encode(png).decode()}'>",
        *promotion_section(summary_rows or []),
    ]
    for round_index, rows in sorted(samples.items()):
        parts.append(f"<h2>Round {round_index}: sample responses of the final policy</h2>")
        parts.append("<table class=samples><tr><th>prompt</th><th>response</th><th>gold</th><th>RM</th></tr>")
        for row in rows:
            # An episode's transcript holds its tool calls and observations; a chat prompt its turns.
            shown = row.get("transcript") or row.get("response")
            parts.append(
                f"<tr><td class=r>{html.escape(prompt_text(row.get('prompt') or ''))}</td>"
                f"<td class=r>{html.escape(str(shown))}</td>"
                f"<td class=n>{format_cell(row.get('gold_score'))}</td>"
                f"<td class=n>{format_cell(row.get('rm_score'))}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(client: Any, config: Config) -> tuple[str, bytes]:
    """(the HTML report, the figure's PNG) of `config`'s run from its MLflow store and checkpoints."""
    _, records = collect(client, config.tracking.experiment, [config.run.name])
    png = plot_curves(records)
    samples = {rec.round_index: sample_rows(config, rec.round_index) for rec in records}
    summary = read_run_file(config.run.root, config.run.name, "summary.json", config.run.storage_options)
    rows = json.loads(summary)["rounds"] if summary else []
    return render_report(config.run.name, records, png, samples, rows), png
