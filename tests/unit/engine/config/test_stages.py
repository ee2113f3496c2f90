"""The stage sections (rlflow.engine.config.stages): the RL loop's mini-batches must tile its
rollout batch (the refusal proposes both fixes), and the bounds and defaults of the others."""

import re

import pytest
from pydantic import ValidationError

from rlflow.engine.config.stages import EvalConfig, LabelConfig, PPOConfig, RewardModelConfig, RLConfig, SFTConfig


@pytest.mark.parametrize(
    ("rollout_batch", "mini_batch", "divisor", "multiple"),
    [(64, 24, 16, 72), (10, 4, 2, 12), (7, 3, 1, 9), (6, 8, 6, 8)],  # 6 < 8: a mini-batch may not be larger
)
def test_a_mini_batch_that_does_not_divide_the_batch_is_refused_with_both_fixes(
    rollout_batch, mini_batch, divisor, multiple
):
    message = (
        f"rl.rollout_batch={rollout_batch} is not a multiple of rl.mini_batch={mini_batch}: every mini-batch is one"
        " optimizer step, so all must be the same size; set rl.mini_batch to a divisor of rl.rollout_batch"
        f" (e.g. {divisor}) or rl.rollout_batch to a multiple of rl.mini_batch (e.g. {multiple})"
    )
    with pytest.raises(ValidationError, match=re.escape(message)):
        RLConfig(rollout_batch=rollout_batch, mini_batch=mini_batch)


def test_mini_batches_that_tile_the_batch_pass():
    assert RLConfig(rollout_batch=64, mini_batch=16).mini_batch == 16
    assert RLConfig(rollout_batch=5, mini_batch=5).rollout_batch == 5
    assert (RLConfig().rollout_batch, RLConfig().mini_batch) == (64, 32)


@pytest.mark.parametrize(
    ("cls", "keys", "field"),
    [(SFTConfig, {"max_seq_tokens": 7}, "max_seq_tokens"), (SFTConfig, {"lr": 0}, "lr"),
     (RewardModelConfig, {"norm_samples": 1}, "norm_samples"), (RLConfig, {"gamma": 1.5}, "gamma"),
     (RLConfig, {"loss_agg": "sum"}, "loss_agg"), (PPOConfig, {"critic_init": "random"}, "critic_init"),
     (EvalConfig, {"curve_prompts": 0}, "curve_prompts"), (LabelConfig, {"eval_fraction": 1.0}, "eval_fraction")],
)  # fmt: skip
def test_out_of_range_values_name_their_field(cls, keys, field):
    with pytest.raises(ValidationError) as info:
        cls(**keys)
    assert info.value.errors()[0]["loc"] == (field,)


def test_the_default_labeller_is_the_demo_tasksets_noisy_gold_labeller():
    labeller = LabelConfig().labeller
    assert (labeller.fn, labeller.kwargs) == ("rlflow.engine.tasksets.demo:noisy_gold_labeller", {"noise": 0.1})
    assert LabelConfig(online_from_round=None).online_from_round is None  # offline preferences only
    assert SFTConfig().rounds == [0] and SFTConfig(rounds=[0, 2]).rounds == [0, 2]
