"""The promotion section: gates need a known metric and a finite bound, min not above max."""

import pytest
from pydantic import ValidationError

from rlflow.engine.config.promotion import PromotionConfig, PromotionGate


def test_the_defaults_are_off_with_three_gates_that_need_no_gold():
    config = PromotionConfig()
    assert config.enabled is False and config.on_reject == "continue"
    assert [(g.metric, g.min, g.max, g.optional) for g in config.gates] == [
        ("valid_drop", None, 0.1, False),
        ("distinct_2_ratio", 0.8, None, True),  # one-word answers have no word pairs
        ("length_ratio", 0.5, 2.0, False),
    ]
    assert not any(g.metric.startswith("gold") for g in config.gates)


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
