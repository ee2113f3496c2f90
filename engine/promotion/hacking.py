"""The reward-hacking detector: pure functions over the RL stage's per-step signals.

Each RL step's samples give four numbers: the proxy (the reward RL optimises, critic/score/mean),
the declared judge's mean score (a reward source of weight 0: it never enters the reward), the
declared valid rule's share of valid answers, and the reward-model ensemble's spread
(critic/score_std_ensemble). The first `window` steps, sampled from (close to) the round's start,
are the baseline; the last `window` steps are compared with it. A round diverges when

- proxy_vs_judge: the proxy rose while the judge fell by more than `min_judge_drop` and by more
  than twice the standard error of the two windows' difference (from the steps' own spread, so a
  noisy judge's step-to-step wobble is not a fall);
- valid_drop: the valid share fell more than `max_valid_drop` below the baseline's;
- spread: the ensemble's spread grew above `max_spread_ratio` times the baseline's.

Window means, not single steps: one batch's mean moves by its sampling noise, a window's by
1/sqrt(window) of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SIGNALS = ("proxy", "judge", "valid", "spread")  # a history row: [step, *SIGNALS] (None: not measured)


@dataclass(frozen=True)
class DetectorLimits:
    """The thresholds of hacking.* (engine/config/hacking.py); None: that check is off."""

    window: int
    min_judge_drop: float | None
    max_valid_drop: float | None
    max_spread_ratio: float | None


@dataclass(frozen=True)
class Divergence:
    step: int  # the step it was detected at
    window_start: int  # the first step of the window that diverged: the candidate precedes it
    signal: str  # proxy_vs_judge | valid_drop | spread
    message: str


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _mean(rows: Sequence[Sequence[float | None]], column: int) -> float | None:
    values = [r[column] for r in rows if r[column] is not None]
    return sum(values) / len(values) if values else None


def _stderr_of_difference(base: Sequence[Sequence[float | None]], now: Sequence[Sequence[float | None]], column: int):
    """Standard error of mean(now) - mean(base) of one column, from each window's per-step variance."""
    total = 0.0
    for rows in (base, now):
        values = [r[column] for r in rows if r[column] is not None]
        if len(values) < 2:
            return 0.0
        mean = sum(values) / len(values)
        total += sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)
    return total**0.5


def window_changes(history: Sequence[Sequence[float | None]], window: int) -> dict[str, float]:
    """hacking/* metrics of the last `window` steps against the first `window`: proxy_gain,
    judge_gain (and its standard error, judge_gain_stderr), valid_drop (baseline minus now) and
    spread_ratio; empty until 2 x window steps."""
    if len(history) < 2 * window:
        return {}
    base, now = history[:window], history[-window:]
    out = {}
    for name, column in (("proxy_gain", 1), ("judge_gain", 2), ("valid_drop", 3)):
        before, after = _mean(base, column), _mean(now, column)
        if before is not None and after is not None:
            out[f"hacking/{name}"] = (before - after) if name == "valid_drop" else (after - before)
    if "hacking/judge_gain" in out:
        out["hacking/judge_gain_stderr"] = _stderr_of_difference(base, now, 2)
    before, after = _mean(base, 4), _mean(now, 4)
    if before is not None and after is not None and before > 0:
        out["hacking/spread_ratio"] = after / before
    return out


def detect_divergence(history: Sequence[Sequence[float | None]], limits: DetectorLimits) -> Divergence | None:
    """The first check that fails on the latest window (history rows [step, proxy, judge, valid,
    spread], one per step in order), or None."""
    changes = window_changes(history, limits.window)
    if not changes:
        return None
    step, start = int(history[-1][0]), int(history[-limits.window][0])
    proxy, judge = changes.get("hacking/proxy_gain"), changes.get("hacking/judge_gain")
    checks = [
        (
            "proxy_vs_judge",
            limits.min_judge_drop is not None and proxy is not None and judge is not None
            and proxy > 0 and -judge > max(limits.min_judge_drop, 2 * changes["hacking/judge_gain_stderr"]),
            f"the proxy reward rose {_num(proxy)} while the judge fell {_num(None if judge is None else -judge)}",
        ),
        (
            "valid_drop",
            limits.max_valid_drop is not None and changes.get("hacking/valid_drop", -1.0) > limits.max_valid_drop,
            f"the valid share fell {_num(changes.get('hacking/valid_drop'))} (max {limits.max_valid_drop})",
        ),
        (
            "spread",
            limits.max_spread_ratio is not None and changes.get("hacking/spread_ratio", 0.0) > limits.max_spread_ratio,
            f"the ensemble's spread grew {_num(changes.get('hacking/spread_ratio'))} times"
            f" (max {limits.max_spread_ratio})",
        ),
    ]
    for signal, failed, what in checks:
        if failed:
            window = f"steps {start}-{step} against steps {int(history[0][0])}-{int(history[limits.window - 1][0])}"
            return Divergence(step, start, signal, f"reward hacking ({signal}): {what}, {window}")
    return None


def candidate_step(committed: Sequence[int], window_start: int) -> int | None:
    """The last committed step before a diverged window that starts at `window_start` (None: none)."""
    before = [s for s in committed if s < window_start]
    return max(before) if before else None
