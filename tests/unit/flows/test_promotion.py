"""The flow's side of promotion without a flow run: the gate table's Prefect artifact key, and what
on_reject does after a rejected round: continue, fail, or pause for an operator, whose answers are
given here in place of the Prefect UI (the CLI scenario with a real pause is
tests/scenarios/test_promotion.py)."""

import logging

import pytest

from conftest import small_config_tree
from rlflow.engine.config.promotion import PromotionGate
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import RunHalted
from rlflow.engine.promotion.gates import decide_promotion
from rlflow.flows import breach as flow_breach
from rlflow.flows import promotion as flow_promotion
from rlflow.flows.promotion import Promotion, RejectionAnswer, answer_rejection, artifact_key, read_overrides


def test_the_artifact_key_is_what_prefect_accepts():
    assert artifact_key("Demo_Run.v2", 3) == "promotion-demo-run-v2-round-3"
    assert artifact_key("nightly", 0) == "promotion-nightly-round-0"


ROW = {"valid_fraction_before": 0.8, "valid_fraction": 0.6}
REJECTED = Promotion(decide_promotion(ROW, [PromotionGate(metric="valid_drop", max=0.1)]), None)
PROMOTED = Promotion(decide_promotion(ROW, [PromotionGate(metric="valid_drop", max=0.3)]), "2")


def config(small_assets, tmp_path, on_reject):
    promotion = {"enabled": True, "on_reject": on_reject}
    return build_config(small_config_tree(small_assets, tmp_path, promotion=promotion), "t")


def never(*args):
    raise AssertionError("not asked for")


def test_on_reject_fail_halts_a_rejected_round_with_its_reasons_and_nothing_else(small_assets, tmp_path):
    fail = config(small_assets, tmp_path, "fail")
    with pytest.raises(RunHalted, match=r"round 1's policy \(version 4\) was rejected .*valid_drop: 0.2 > max 0.1"):
        answer_rejection(fail, 1, "4", REJECTED, never, never)
    assert answer_rejection(fail, 1, "4", PROMOTED, never, never) is PROMOTED  # a promoted round goes on
    keep_going = config(small_assets, tmp_path, "continue")
    assert answer_rejection(keep_going, 1, "4", REJECTED, never, never) is REJECTED


def test_on_reject_pause_asks_and_continues_stops_or_promotes_by_hand(small_assets, tmp_path, monkeypatch):
    pause = config(small_assets, tmp_path, "pause")
    monkeypatch.setattr(flow_promotion, "temporary_server", lambda: True)
    with pytest.raises(RunHalted, match="temporary .* cannot pause for an answer. .*rlflow promote t --round 1"):
        answer_rejection(pause, 1, "4", REJECTED, never, never)
    monkeypatch.setattr(flow_promotion, "temporary_server", lambda: False)

    def answer(**fields):
        return lambda cfg, r, rejected: RejectionAnswer(**fields)

    assert answer_rejection(pause, 1, "4", REJECTED, never, answer(action="continue")) is REJECTED
    with pytest.raises(RunHalted, match="rejected by the promotion gates .*; stopped by the operator"):
        answer_rejection(pause, 1, "4", REJECTED, never, answer(action="stop"))
    by_hand = answer(action="promote", operator="ana ", reason="ok")
    settled = answer_rejection(pause, 1, "4", REJECTED, lambda: PROMOTED, by_hand)
    assert settled is PROMOTED and read_overrides(pause) == {1: "ana: ok"}  # the second decision reads it


def test_a_promote_answer_without_a_reason_is_refused_and_asked_again(small_assets, tmp_path, monkeypatch, caplog):
    answers = iter([RejectionAnswer(action="promote", operator="ana"), RejectionAnswer(action="stop")])
    monkeypatch.setattr(flow_breach, "pause_flow_run", lambda **kwargs: next(answers))  # the shared pause
    with caplog.at_level(logging.ERROR):
        answer = flow_promotion.ask_on_rejection(config(small_assets, tmp_path, "pause"), 1, "round 1 rejected")
    assert answer.action == "stop"
    assert "round 1: action promote needs an operator and a reason" in caplog.text
    assert "pausing again" in caplog.text
