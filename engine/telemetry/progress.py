"""What a person (or `jq`) sees of a running stage: a live progress bar, one line per logged
step, the structured event log `events.jsonl`, and the user's callbacks.

All are MetricsSinks, so the stage loops know none of them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, TextIO

from rlflow.engine.telemetry.metrics import ConsoleSink, MetricsSink, NullSink, _short

log = logging.getLogger(__name__)

QUIET_ENV = "RLFLOW_QUIET"  # set by `rlflow run --quiet`: one line per logged step, no bar
# The bar's fields, each from the first of its metric names that a stage logs.
BAR_FIELDS = {
    "tok/s": ("perf/throughput", "perf/tokens_per_s"),
    "reward": ("critic/score/mean", "rm/train_accuracy", "eval/gold_score"),
    "kl": ("actor/kl", "eval/kl"),
    "loss": ("sft/loss", "rm/loss"),
}


def console_sink(
    label: str, total_steps: int | None, keys: tuple[str, ...], stream: TextIO | None = None
) -> MetricsSink:
    """A live bar on a terminal; one line per logged step when quiet, piped or logged to a file."""
    stream = stream or sys.stdout
    if total_steps and not os.environ.get(QUIET_ENV) and stream.isatty():
        return ProgressSink(label, total_steps, stream)
    return ConsoleSink(label, total_steps, keys, stream)


class ProgressSink(NullSink):
    """A rich progress bar per stage: step/total, tokens/s, reward, KL, elapsed and ETA."""

    def __init__(self, label: str, total_steps: int, stream: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.progress import TimeRemainingColumn

        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[values]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=stream),
            transient=False,
        )
        self.task = self.progress.add_task(label, total=total_steps, values="")
        self.started = False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.started:
            self.progress.start()
            self.started = True
        self.progress.update(self.task, completed=step, values=bar_values(metrics))

    def close(self) -> None:
        """Ends the live display, whatever ended the stage (its last step, an early stop, an error)."""
        if self.started:
            self.progress.stop()
            self.started = False


def bar_values(metrics: Mapping[str, float]) -> str:
    """`tok/s=512 reward=0.31 kl=0.02`: the BAR_FIELDS this step logged."""
    shown = []
    for label, names in BAR_FIELDS.items():
        name = next((n for n in names if n in metrics), None)
        if name is not None:
            shown.append(f"{label}={_short(float(metrics[name]))}")
    return " ".join(shown)


def events_path(root: str, run_name: str) -> Path:
    """`<root>/<run>/events.jsonl` for a local run root; a remote root (s3://) keeps its event
    log locally under ./runs/<run>/, as it does the default MLflow store."""
    if root.startswith("file://"):
        root = root[len("file://") :]
    elif "://" in root:
        root = "runs"
    return Path(root) / run_name / "events.jsonl"


class EventLogSink(NullSink):
    """One JSON object per logged step, appended to events.jsonl: run, round, stage, step, time
    (ISO 8601 UTC) and the step's metrics under their MLflow names (`jq '."actor/kl"'`).

    A resumed stage recomputes the steps after its last checkpoint; they are already in the
    log, so steps up to the last one logged for this (round, stage) are skipped, as in MLflow.
    """

    def __init__(self, path: Path, run_name: str, round_index: int, stage: str):
        self.path, self.head = path, {"run": run_name, "round": round_index, "stage": stage}
        self.last_step = self._last_logged_step()

    def _last_logged_step(self) -> int:
        last = -1
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return last
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:  # a line torn by a kill mid-write: later appends start a new line
                continue
            if event.get("round") == self.head["round"] and event.get("stage") == self.head["stage"]:
                last = max(last, int(event.get("step", -1)))
        return last

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.last_step:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {**self.head, "step": int(step), "time": stamp}
        event |= {k: _json_number(v) for k, v in metrics.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write("\n" + json.dumps(event) if self._torn() else json.dumps(event))
            f.write("\n")
        self.last_step = step

    def _torn(self) -> bool:
        """Whether the file ends mid-line (a kill during a write): the next event starts a new line."""
        try:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                return f.read(1) != b"\n"
        except OSError:
            return False


def _json_number(value: float) -> float | str:
    """JSON has no NaN or infinity: those are written as the strings "nan", "inf", "-inf"."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


@dataclass(frozen=True)
class StepEvent:
    """What a callback receives for every logged step (metrics under their MLflow names)."""

    run: str
    round_index: int
    stage: str
    step: int
    metrics: Mapping[str, float]


Callback = Callable[[StepEvent], "Mapping[str, float] | None"]


class StopStage(Exception):
    """Raised by a callback: end this SFT or PPO stage after the current step, as if it were its
    last (a checkpoint is committed and the stage finishes; the round goes on). The message is
    the reason, logged and kept as the stage's `train/early_stop_step` metric's cause."""


@dataclass
class StopRequest:
    """Shared by the callbacks' sink and the stage's guard of one in-process stage."""

    reason: str | None = None
    step: int | None = None


class CallbackSink(NullSink):
    """Wraps the stage's sinks: calls each `callbacks:` function with every logged step, then logs
    the step with what the callbacks returned (a mapping of numbers: custom metrics) added. A
    callback that raises StopStage ends the stage early (see StopStage); any other exception
    stops the stage with that error after the step is logged: the last committed checkpoint is
    kept, and running the same command again continues from it."""

    def __init__(
        self,
        callbacks: list[tuple[str, Callback]],
        downstream: MetricsSink,
        head: dict[str, Any],
        stop: StopRequest | None = None,
    ):
        self.callbacks, self.downstream, self.head, self.stop = callbacks, downstream, head, stop

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        try:
            extra = self._call_all(metrics, step)
        except BaseException:
            self.downstream.log_metrics(metrics, step)
            raise
        self.downstream.log_metrics(metrics | extra, step)

    def _call_all(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        event = StepEvent(
            self.head["run"], self.head["round"], self.head["stage"], step, MappingProxyType(dict(metrics))
        )
        extra: dict[str, float] = {}
        for ref, fn in self.callbacks:
            try:
                returned = fn(event)
            except StopStage as exc:
                self._request_stop(ref, step, exc)
                continue
            if returned is None:
                continue
            if not isinstance(returned, Mapping) or not all(isinstance(v, (int, float)) for v in returned.values()):
                raise TypeError(f"callbacks: {ref} must return None or a mapping of metric name to number")
            extra |= {str(k): float(v) for k, v in returned.items()}
        return extra

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        self.downstream.log_table(name, rows)

    def log_text(self, name: str, text: str) -> None:
        self.downstream.log_text(name, text)

    def close(self) -> None:
        self.downstream.close()

    def _request_stop(self, ref: str, step: int, exc: StopStage) -> None:
        if self.stop is None:  # a distributed stage's ranks cannot hear this process
            raise RuntimeError(
                f"callbacks: {ref} asked to stop {self.head['stage']} at step {step} ({exc}), but an early stop"
                " needs engine.backend=torch; the stage stops here, its last committed checkpoint kept"
            ) from exc
        if self.stop.reason is None:
            self.stop.reason, self.stop.step = f"{ref}: {exc}", step
            log.warning(
                "round %s %s: %s asked to stop after step %d: %s",
                self.head["round"],
                self.head["stage"],
                ref,
                step,
                exc,
            )
