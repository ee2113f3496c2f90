"""The promotion section: gates need a known metric and a finite bound, min not above max."""

import pytest
from pydantic import ValidationError

from rlflow.engine.promotion.gates import decide_promotion
from rlflow.engine.config.promotion import PromotionConfig, PromotionGate


def test_the_defaults_are_on_with_three_gates_that_need_no_gold():
    config = PromotionConfig()
    assert config.enabled is True and config.on_reject == "continue"
    assert [(g.metric, g.min, g.max, g.optional) for g in config.gates] == [
        ("valid_drop", None, 0.15, False),
        ("distinct_2_ratio", 0.6, None, True),  # one-word answers have no word pairs
        ("length_ratio", 0.5, 2.0, False),
    ]
    assert not any(g.metric.startswith("gold") for g in config.gates)
    # The demo rounds they were set from (docs/promotion.md): fewer phrasings at a higher valid share
    # passes (distinct-2 0.746 of the start), the KL-free collapse (0.49) and a valid share
    # falling 1.00 -> 0.72 do not.
    start = {"valid_fraction_before": 1.0, "distinct_2_before": 0.74, "response_length_before": 13.0}
    healthy = start | {"valid_fraction": 0.898, "distinct_2": 0.552, "response_length": 14.2}
    assert decide_promotion(healthy, config.gates).promoted
    collapsed = healthy | {"distinct_2": 0.49 * 0.74}
    assert [g.metric for g in decide_promotion(collapsed, config.gates).failed] == ["distinct_2_ratio"]
    hacked = healthy | {"valid_fraction": 0.719}
    assert [g.metric for g in decide_promotion(hacked, config.gates).failed] == ["valid_drop"]


@pytest.mark.parametrize(
    "gate, message",
    [
        ({"metric": "valid_drop"}, "needs min or max"),
        ({"metric": "kl", "max": float("inf")}, "must be finite"),
        ({"metric": "length_ratio", "min": 2.0, "max": 1.0}, "min 2.0 is above max 1.0"),
        ({"metric": "reward_mean", "min": 0}, "valid_fraction"),  # the error lists the valid metrics
    ],
)
def test_a_bad_gate_is_refused_with_what_is_wrong(gate, message):
    with pytest.raises(ValidationError, match=message):
        PromotionGate(**gate)


def test_on_reject_takes_only_the_known_actions():
    with pytest.raises(ValidationError, match="continue"):
        PromotionConfig(on_reject="retry")
