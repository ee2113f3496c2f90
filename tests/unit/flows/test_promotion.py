"""The flow's side of promotion without a flow run: the gate table's Prefect artifact key, and
on_reject=fail halting only a rejected round (the CLI scenario is tests/scenarios/test_promotion.py)."""

import pytest

from conftest import small_config_tree
from rlflow.engine.config.promotion import PromotionGate
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import RunHalted
from rlflow.engine.promotion.gates import decide_promotion
from rlflow.flows.promotion import Promotion, artifact_key, halt_on_rejection


def test_the_artifact_key_is_what_prefect_accepts():
    assert artifact_key("Demo_Run.v2", 3) == "promotion-demo-run-v2-round-3"
    assert artifact_key("nightly", 0) == "promotion-nightly-round-0"


def test_on_reject_fail_halts_a_rejected_round_with_its_reasons_and_nothing_else(small_assets, tmp_path):
    row = {"valid_fraction_before": 0.8, "valid_fraction": 0.6}
    rejected = Promotion(decide_promotion(row, [PromotionGate(metric="valid_drop", max=0.1)]), None)
    promoted = Promotion(decide_promotion(row, [PromotionGate(metric="valid_drop", max=0.3)]), "2")
    on_fail = {"enabled": True, "on_reject": "fail"}
    fail = build_config(small_config_tree(small_assets, tmp_path, promotion=on_fail), "t")
    keep_going = build_config(small_config_tree(small_assets, tmp_path, promotion={"enabled": True}), "t")
    with pytest.raises(RunHalted, match=r"round 1's policy \(version 4\) was rejected .*valid_drop: 0.2 > max 0.1"):
        halt_on_rejection(fail, 1, "4", rejected)
    halt_on_rejection(fail, 1, "4", promoted)  # a promoted round goes on
    halt_on_rejection(keep_going, 1, "4", rejected)  # on_reject=continue goes on
