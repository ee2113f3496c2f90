"""How stages report numbers: a tiny callback interface, so the engine never imports a tracker.

The MLflow implementation lives in rlflow.tasks.tracking; the console one is here.
"""

from __future__ import annotations

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


class NullSink:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def log_text(self, name: str, text: str) -> None:
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


def _short(value: float) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)
