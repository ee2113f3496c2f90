"""Promotion gates on hand-built summary rows: each metric's formula, the bounds, a metric the round
did not measure (fails closed, or skipped where optional), and the table's verdicts."""

import math

import pytest

from rlflow.engine.config.promotion import PromotionGate
from rlflow.engine.promotion.gates import GATE_METRICS, check_gate, decide_promotion, gate_table

ROW = {
    "round": 1,
    "valid_fraction_before": 0.80,
    "valid_fraction": 0.62,
    "distinct_2_before": 0.50,
    "distinct_2": 0.45,
    "response_length_before": 10.0,
    "response_length": 25.0,
    "kl": 0.3,
    "rm_accuracy": 0.7,
    "rm_accuracy_online": None,
    "gold_score_before": 0.40,
    "gold_score_after": 0.46,
    "gold_score_stderr": 0.05,
    "gold_gain_stderr": 0.02,  # paired: smaller than the score's own
    "valid_drop_stderr": 0.06,
    "judge_score_before": 0.50,
    "judge_score_after": 0.30,
    "judge_gain_stderr": 0.05,
    "judge_agreement": 0.25,
    "regression_nll_before": 2.0,
    "regression_nll_after": 2.3,
    "regression_nll_increase_stderr": 0.1,
}


def test_each_metric_is_computed_from_the_row_by_its_formula():
    values = {name: fn(ROW) for name, fn in GATE_METRICS.items()}
    assert values["valid_fraction"] == 0.62
    assert values["valid_drop"] == pytest.approx(0.18)  # 0.80 - 0.62
    assert values["distinct_2_ratio"] == pytest.approx(0.9)  # 0.45 / 0.50
    assert values["length_ratio"] == pytest.approx(2.5)  # 25 / 10
    assert values["kl"] == 0.3 and values["rm_accuracy"] == 0.7
    assert values["rm_accuracy_online"] is None  # no online labels this round
    assert values["gold_gain"] == pytest.approx(0.06)
    assert values["gold_gain_z"] == pytest.approx(3.0)  # 0.06 / 0.02, the paired standard error
    assert values["valid_drop_z"] == pytest.approx(3.0)  # 0.18 / 0.06
    assert values["judge_gain"] == pytest.approx(-0.2)  # the judge fell while the reward model's score rose
    assert values["judge_gain_z"] == pytest.approx(-4.0)  # -0.2 / 0.05
    assert values["judge_agreement"] == 0.25
    assert values["regression_nll_increase"] == pytest.approx(0.3)  # 2.3 - 2.0 nats per token
    assert values["regression_nll_increase_z"] == pytest.approx(3.0)
    no_judge = {k: v for k, v in ROW.items() if not k.startswith("judge")}
    assert [GATE_METRICS[k](no_judge) for k in ("judge_gain", "judge_gain_z", "judge_agreement")] == [None] * 3


def test_a_ratio_over_nothing_and_a_zero_stderr_are_not_measurements():
    row = ROW | {"response_length_before": 0.0, "gold_gain_stderr": 0.0, "distinct_2": float("nan")}
    assert GATE_METRICS["length_ratio"](row) is None
    assert GATE_METRICS["gold_gain_z"](row) is None
    assert GATE_METRICS["valid_drop_z"](ROW | {"valid_drop_stderr": None}) is None  # cached before it existed
    unchanged = ROW | {"valid_fraction": 0.80, "valid_drop_stderr": 0.0}  # an identical candidate
    assert GATE_METRICS["valid_drop_z"](unchanged) == 0.0
    assert GATE_METRICS["distinct_2_ratio"](row) is None


def test_bounds_pass_and_fail_with_the_value_in_the_reason():
    assert check_gate(PromotionGate(metric="valid_drop", max=0.1), ROW).passed is False
    result = check_gate(PromotionGate(metric="valid_drop", max=0.1), ROW)
    assert result.reason == "0.18 > max 0.1" and result.value == pytest.approx(0.18)
    assert check_gate(PromotionGate(metric="valid_drop", max=0.2), ROW).passed is True
    low = check_gate(PromotionGate(metric="distinct_2_ratio", min=0.95), ROW)
    assert (low.passed, low.reason) == (False, "0.9 < min 0.95")
    inside = check_gate(PromotionGate(metric="length_ratio", min=0.5, max=3.0), ROW)
    assert inside.passed is True and inside.reason == "2.5 within bounds"
    edge = check_gate(PromotionGate(metric="kl", max=0.3), ROW)  # a bound is inclusive
    assert edge.passed is True


def test_a_gate_without_data_fails_closed_unless_it_is_optional():
    closed = check_gate(PromotionGate(metric="rm_accuracy_online", min=0.6), ROW)
    assert closed.passed is False and closed.value is None
    assert "not measured this round" in closed.reason and "fails" in closed.reason
    skipped = check_gate(PromotionGate(metric="rm_accuracy_online", min=0.6, optional=True), ROW)
    assert skipped.passed is None and skipped.reason.startswith("skipped")
    missing_key = check_gate(PromotionGate(metric="gold_gain", min=0.0), {"round": 0})
    assert missing_key.passed is False


def test_the_decision_checks_every_gate_and_promotes_only_when_none_fails():
    gates = [
        PromotionGate(metric="valid_drop", max=0.1),  # fails
        PromotionGate(metric="gold_gain", min=0.0),  # passes
        PromotionGate(metric="rm_accuracy_online", min=0.6, optional=True),  # skipped
        PromotionGate(metric="length_ratio", max=2.0),  # fails
    ]
    decision = decide_promotion(ROW, gates)
    assert decision.promoted is False
    assert [g.passed for g in decision.gates] == [False, True, None, False]  # no short circuit
    assert [g.metric for g in decision.failed] == ["valid_drop", "length_ratio"]
    passing = decide_promotion(ROW, gates[1:3])
    assert passing.promoted is True and passing.failed == ()
    assert decide_promotion(ROW, []).promoted is True  # no gates: nothing can reject


def test_the_summary_row_and_the_table_carry_each_gate():
    decision = decide_promotion(ROW, [PromotionGate(metric="valid_drop", max=0.1), PromotionGate(metric="kl", max=1)])
    row = decision.as_row("3")
    assert row["decision"] == "rejected" and row["champion_version"] == "3"
    assert row["gates"][0] == {
        "metric": "valid_drop", "value": pytest.approx(0.18), "min": None, "max": 0.1, "passed": False,
        "reason": "0.18 > max 0.1",
    }
    table = gate_table(decision, 1)
    assert table.startswith("### Round 1: rejected")
    assert "| valid_drop | 0.18 | - | 0.1 | **fail**: 0.18 > max 0.1 |" in table
    assert "| kl | 0.3 | - | 1 | pass: 0.3 within bounds |" in table
    assert all(math.isfinite(g["value"]) for g in row["gates"])


def test_an_override_promotes_a_rejected_round_and_is_kept_only_where_it_decided():
    gates = [PromotionGate(metric="valid_drop", max=0.1)]
    by_hand = decide_promotion(ROW, gates, override="ana: reviewed, near misses")
    assert by_hand.promoted and [g.metric for g in by_hand.failed] == ["valid_drop"]
    assert by_hand.as_row("3") | {"gates": None} == {
        "decision": "promoted",
        "champion_version": "3",
        "gates": None,
        "override": "ana: reviewed, near misses",
    }
    assert "### Round 1: promoted by hand (ana: reviewed, near misses), over the failed gates" in gate_table(by_hand, 1)
    passing = decide_promotion(ROW, [PromotionGate(metric="valid_drop", max=0.2)], override="ana: reviewed")
    assert passing.promoted and passing.override is None and "override" not in passing.as_row("3")
