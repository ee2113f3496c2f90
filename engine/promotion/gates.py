"""Promotion gates: pure decisions on a round's evaluation summary (no MLflow, no files).

A round's final policy is a candidate. Each gate reads one metric of the round's summary row
(flows/rounds.py `_summary_row`: the candidate's and the round start's evaluation on the same
prompts) and passes when it is inside its bounds. A metric the round did not measure fails the gate
(closed) unless the gate is optional; the candidate is promoted only when no gate fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

Row = Mapping[str, Any]


def _value(row: Row, key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _difference(row: Row, a: str, b: str) -> float | None:
    x, y = _value(row, a), _value(row, b)
    return None if x is None or y is None else x - y


def _ratio(row: Row, a: str, b: str) -> float | None:
    x, y = _value(row, a), _value(row, b)
    return None if x is None or y is None or y <= 0 else x / y


GATE_METRICS: dict[str, Callable[[Row], float | None]] = {
    # the candidate's share of valid answers, and how far it fell from the round start's
    "valid_fraction": lambda r: _value(r, "valid_fraction"),
    "valid_drop": lambda r: _difference(r, "valid_fraction_before", "valid_fraction"),
    # distinct-2 and mean response length (tokens), candidate over round start
    "distinct_2_ratio": lambda r: _ratio(r, "distinct_2", "distinct_2_before"),
    "length_ratio": lambda r: _ratio(r, "response_length", "response_length_before"),
    # token-mean KL (k3) of the candidate to the round's reference, on the candidate's answers
    "kl": lambda r: _value(r, "kl"),
    # the round's reward model: held-out pair accuracy (offline pairs; online pairs where labelled)
    "rm_accuracy": lambda r: _value(r, "rm_accuracy"),
    "rm_accuracy_online": lambda r: _value(r, "rm_accuracy_online"),
    # gold (where a gold function or verifier exists): the gain over the round start
    "gold_gain": lambda r: _difference(r, "gold_score_after", "gold_score_before"),
    # z-scores: a change over the standard error of its per-prompt differences (paired on the same
    # prompts and seed), so a gate can ask for a change beyond the evaluation's noise
    "gold_gain_z": lambda r: _z(GATE_METRICS["gold_gain"](r), _value(r, "gold_gain_stderr")),
    "valid_drop_z": lambda r: _z(GATE_METRICS["valid_drop"](r), _value(r, "valid_drop_stderr")),
    # the independent judge (reward.judge, outside the reward): its gain over the round start, that
    # gain's z, and the share of prompts where it agrees with the reward model on which answer is better
    "judge_gain": lambda r: _difference(r, "judge_score_after", "judge_score_before"),
    "judge_gain_z": lambda r: _z(GATE_METRICS["judge_gain"](r), _value(r, "judge_gain_stderr")),
    "judge_agreement": lambda r: _value(r, "judge_agreement"),
    # the fixed regression set (data.regression): the rise of the mean NLL per response token of its
    # reference responses, candidate minus start (nats), and that rise's z
    "regression_nll_increase": lambda r: _difference(r, "regression_nll_after", "regression_nll_before"),
    "regression_nll_increase_z": lambda r: _z(
        GATE_METRICS["regression_nll_increase"](r), _value(r, "regression_nll_increase_stderr")
    ),
}


def _z(gain: float | None, stderr: float | None) -> float | None:
    if gain is None or stderr is None:
        return None
    if stderr > 0:
        return gain / stderr
    # No spread in the differences: nothing changed (an identical candidate) is z 0; every prompt
    # changed alike gives no z, and the gate says "not measured" (valid_drop itself still judges it).
    return 0.0 if gain == 0 else None


class Gate(Protocol):
    metric: str
    min: float | None
    max: float | None
    optional: bool


@dataclass(frozen=True)
class GateResult:
    metric: str
    value: float | None  # None: the round did not measure it
    min: float | None
    max: float | None
    passed: bool | None  # None: skipped (optional, no data)
    reason: str  # why it passed, failed or was skipped, for the tags and the gate table


@dataclass(frozen=True)
class PromotionDecision:
    promoted: bool
    gates: tuple[GateResult, ...]
    override: str | None = None  # "<who>: <why>" of a manual promotion (`rlflow promote`) of a rejected round

    @property
    def failed(self) -> tuple[GateResult, ...]:
        return tuple(g for g in self.gates if g.passed is False)

    def as_row(self, champion_version: str | None) -> dict[str, Any]:
        """The summary.json form: {decision, champion_version, gates}."""
        decision = "promoted" if self.promoted else "rejected"
        row = {"decision": decision, "champion_version": champion_version, "gates": [asdict(g) for g in self.gates]}
        return row | ({"override": self.override} if self.override else {})


def check_gate(gate: Gate, row: Row) -> GateResult:
    value = GATE_METRICS[gate.metric](row)
    bounds = (gate.min, gate.max)
    if value is None:
        if gate.optional:
            return GateResult(gate.metric, None, *bounds, None, "skipped: not measured this round (optional)")
        return GateResult(gate.metric, None, *bounds, False, "not measured this round: a gate without data fails")
    if gate.min is not None and value < gate.min:
        return GateResult(gate.metric, value, *bounds, False, f"{value:.4g} < min {gate.min:g}")
    if gate.max is not None and value > gate.max:
        return GateResult(gate.metric, value, *bounds, False, f"{value:.4g} > max {gate.max:g}")
    return GateResult(gate.metric, value, *bounds, True, f"{value:.4g} within bounds")


def decide_promotion(row: Row, gates: Sequence[Gate], override: str | None = None) -> PromotionDecision:
    """Every gate checked (none short-circuits, so the table is complete); promoted when none fails,
    or when an operator promoted the round by hand (`override`: who and why; the gates still shown)."""
    results = tuple(check_gate(g, row) for g in gates)
    passed = all(r.passed is not False for r in results)
    return PromotionDecision(passed or override is not None, results, None if passed else override)


def gate_table(decision: PromotionDecision, round_index: int) -> str:
    """The markdown table of a round's gates (the Prefect artifact and the MLflow text)."""
    verdict = "promoted" if decision.promoted else "rejected"
    if decision.override:
        verdict += f" by hand ({decision.override}), over the failed gates below"
    lines = [f"### Round {round_index}: {verdict}", ""]
    lines += ["| gate | value | min | max | result |", "|---|---|---|---|---|"]
    for g in decision.gates:
        result = {True: "pass", False: "**fail**", None: "skipped"}[g.passed]
        cells = ("-" if v is None else f"{v:.4g}" for v in (g.value, g.min, g.max))
        lines.append(f"| {g.metric} | {' | '.join(cells)} | {result}: {g.reason} |")
    return "\n".join(lines) + "\n"
