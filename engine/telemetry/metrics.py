"""How stages report numbers: a tiny callback interface, so the engine never imports a tracker.

The MLflow implementation lives in rlflow.tasks.tracking; the console one is here.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Protocol, TextIO


class MetricsSink(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at a stage step (names use stable slash names: actor/pg_loss)."""

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Record a small table (e.g. evaluation samples) as an artifact named `name` (.json)."""

    def log_text(self, name: str, text: str) -> None:
        """Record a text artifact (e.g. a checkpoint URI) under the file name `name`."""

    def close(self) -> None:
        """The stage is over (finished or failed): release what the sink holds (a live display)."""


class NullSink:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def log_text(self, name: str, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleSink(NullSink):
    """One progress line per logged step: `[round 0 ppo] step 12/40 (3.1 s) key=value ...`."""

    def __init__(self, label: str, total_steps: int | None, keys: tuple[str, ...] = (), stream: TextIO | None = None):
        self.label, self.total_steps, self.keys = label, total_steps, keys
        self.stream = stream or sys.stdout
        self.started = time.monotonic()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        shown = [k for k in self.keys if k in metrics] or sorted(metrics)[:6]
        values = " ".join(f"{k}={_short(metrics[k])}" for k in shown)
        total = f"/{self.total_steps}" if self.total_steps else ""
        elapsed = time.monotonic() - self.started
        print(f"[{self.label}] step {step}{total} ({elapsed:.1f} s) {values}", file=self.stream, flush=True)


class FanoutSink(NullSink):
    def __init__(self, *sinks: MetricsSink):
        self.sinks = sinks

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log_metrics(metrics, step)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        for sink in self.sinks:
            sink.log_table(name, rows)

    def log_text(self, name: str, text: str) -> None:
        for sink in self.sinks:
            sink.log_text(name, text)

    def close(self) -> None:
        for sink in self.sinks:
            getattr(sink, "close", lambda: None)()  # a sink with nothing to release may leave it out


def _short(value: float) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


EVENT_PREFIX = "@@rlflow-event "  # a line a worker rank prints for the task to replay into its sink


class EventSink(NullSink):
    """A distributed stage's rank 0 reports through its output stream: one JSON line per call,
    replayed by the launching task into the real sinks (console, MLflow) with `replay_event`."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout

    def _emit(self, kind: str, **payload: Any) -> None:
        self.stream.write(EVENT_PREFIX + json.dumps({"kind": kind, **payload}, allow_nan=True) + "\n")
        self.stream.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._emit("metrics", step=step, metrics={k: float(v) for k, v in metrics.items()})

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        self._emit("table", name=name, rows=rows)

    def log_text(self, name: str, text: str) -> None:
        self._emit("text", name=name, text=text)


def replay_event(line: str, sink: MetricsSink) -> bool:
    """If `line` is an EventSink line, hand its call to `sink` and return True."""
    if not line.startswith(EVENT_PREFIX):
        return False
    event = json.loads(line[len(EVENT_PREFIX) :])
    if event["kind"] == "metrics":
        sink.log_metrics(event["metrics"], event["step"])
    elif event["kind"] == "table":
        sink.log_table(event["name"], event["rows"])
    elif event["kind"] == "text":
        sink.log_text(event["name"], event["text"])
    return True
