"""The kl section on its own: where the KL acts for each algorithm, which estimator that means, and
the bounds of its numbers."""

import pytest
from pydantic import ValidationError

from rlflow.engine.config.kl import DEFAULT_KL_IN_LOSS, KLConfig
from rlflow.engine.config.methods import ALGORITHMS


def test_the_algorithm_decides_where_the_kl_goes_unless_in_loss_is_set():
    unset = KLConfig()
    assert {name: unset.placed_in_loss(name) for name in ALGORITHMS} == DEFAULT_KL_IN_LOSS
    assert unset.placed_in_loss("grpo") and not unset.placed_in_loss("ppo")
    assert not KLConfig(in_loss=False).placed_in_loss("grpo")
    assert KLConfig(in_loss=True).placed_in_loss("rloo")


def test_an_unset_estimator_is_k1_in_the_reward_and_low_var_kl_in_the_loss():
    assert (KLConfig().estimator_for(False), KLConfig().estimator_for(True)) == ("k1", "low_var_kl")
    for estimator in ("k1", "k2", "k3", "abs", "low_var_kl"):  # one choice, wherever the KL acts
        chosen = KLConfig(estimator=estimator)
        assert chosen.estimator_for(False) == chosen.estimator_for(True) == estimator


@pytest.mark.parametrize(
    ("keys", "field"),
    [({"coef": -0.1}, "coef"), ({"target": 0.0}, "target"), ({"pause_patience": 0}, "pause_patience"),
     ({"stop_above": 0.0}, "stop_above"), ({"estimator": "k4"}, "estimator"), ({"horizon": 0}, "horizon")],
)  # fmt: skip
def test_out_of_range_values_are_refused(keys, field):
    with pytest.raises(ValidationError) as info:
        KLConfig(**keys)
    assert info.value.errors()[0]["loc"] == (field,)


def test_the_limits_default_to_a_planned_stop_and_no_breaker():
    kl = KLConfig()
    assert (kl.stop_above, kl.pause_above, kl.pause_patience) == (0.3, None, 3)
