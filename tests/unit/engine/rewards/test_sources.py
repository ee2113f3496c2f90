"""The RL stage's reward source in one process: learned sources' normalised scores, the weighted
sum and its metrics, failures settling into errors, and the fallback rule's frozen normalisation."""

import math

import pytest
import torch

from rlflow.engine.config.base import FunctionRef
from rlflow.engine.config.methods import RewardConfig, RewardSourceConfig
from rlflow.engine.data.records import PromptRecord
from rlflow.engine.errors import ConfigError, RewardSourceError
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.rewards.sources import (
    FallbackState,
    LearnedSource,
    RewardSource,
    build_reward_source,
    named_source,
    source_scorer,
    start_reward_pool,
)
from rlflow.engine.rollout.generate import RolloutBatch


class LastTokenScorer(torch.nn.Module):
    """Value at each position = the token id there (times `scale`): a row's score is read off the batch."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.scale = scale

    def forward(self, input_ids, attention_mask):
        return input_ids.float() * self.scale


BATCH = RolloutBatch(
    input_ids=torch.tensor([[1, 4], [1, 6], [1, 8]]),
    attention_mask=torch.ones(3, 2, dtype=torch.long),
    response_mask=torch.ones(3, 1),
    prompt_width=1,
    response_texts=("a", "bb", "cccc"),
)
RECORDS = [PromptRecord(f"p{i}", {"i": i}) for i in range(3)]


def test_learned_scores_are_normalised_per_source_and_summed_with_weights():
    source = RewardSource(
        [LearnedSource("rm", 2.0, LastTokenScorer(), (6.0, 2.0)), LearnedSource("raw", 0.5, LastTokenScorer(), (0, 1))],
        rule=None,
    )
    scores = source.model_scores(BATCH, rows=3, step=0)
    assert scores.tolist() == [[-1.0, 4.0], [0.0, 6.0], [1.0, 8.0]]
    source.settle()  # nothing failed
    final = source.final_scores(scores, RECORDS, BATCH.response_texts)
    assert final.tolist() == [0.0, 3.0, 6.0]  # 2 x (-1) + 0.5 x 4, ...
    assert source.metrics == {"reward/rm/mean": 0.0, "reward/raw/mean": 6.0}


def test_a_non_finite_model_score_fails_the_step_at_settle_naming_the_count():
    source = RewardSource([LearnedSource("rm", 1.0, LastTokenScorer(scale=math.inf), (0.0, 1.0))], rule=None)
    source.model_scores(BATCH, rows=3, step=7)
    with pytest.raises(RewardSourceError, match="returned 3 non-finite score.s. of 3 at step 7"):
        source.settle()
    source.settle()  # the failure was reported once, not kept


def test_activating_the_fallback_needs_a_rule():
    with pytest.raises(RewardSourceError, match="needs reward.fallback_rule.fn"):
        RewardSource([], rule=None).activate_fallback()


def test_the_fallback_rules_scores_are_standardised_by_its_first_batch_then_frozen():
    rule = FunctionRef(fn="helpers.reward_fns:scaled_length", kwargs={"scale": 1.0})
    source = RewardSource([LearnedSource("rm", 1.0, LastTokenScorer(), (0.0, 1.0))], rule=rule)
    assert source.activate_fallback() == "helpers.reward_fns:scaled_length"
    placeholders = source.model_scores(BATCH, rows=3, step=0)
    assert placeholders.tolist() == [[0.0], [0.0], [0.0]]  # the failed model is not asked again
    first = source.final_scores(placeholders, RECORDS, ["a", "bb", "cccc"])
    # lengths 1, 2, 4: mean 7/3, sample std sqrt(((4/3)^2 + (1/3)^2 + (5/3)^2) / 2) = sqrt(7/3)
    mean, std = 7 / 3, math.sqrt(7 / 3)
    assert first.tolist() == pytest.approx([(1 - mean) / std, (2 - mean) / std, (4 - mean) / std], rel=1e-6)
    assert source.fallback == FallbackState("helpers.reward_fns:scaled_length", pytest.approx(mean), pytest.approx(std))
    later = source.final_scores(placeholders[:1], RECORDS[:1], ["abcdef"])
    assert later.tolist() == pytest.approx([(6 - mean) / std], rel=1e-6)  # the first batch's numbers, kept
    assert source.metrics == {}


def test_a_fallback_rule_that_scores_everything_alike_divides_by_one():
    source = RewardSource([], rule=FunctionRef(fn="helpers.reward_fns:constant_rule"))
    source.activate_fallback()
    scores = source.final_scores(torch.zeros(3, 0), RECORDS, ["a", "b", "c"])
    assert scores.tolist() == [0.0, 0.0, 0.0]
    assert (source.fallback.mean, source.fallback.std) == (0.5, 1.0)


def test_a_fallback_rule_that_cannot_be_imported_fails_when_the_source_is_built():
    with pytest.raises(ConfigError, match=r"reward\.fallback_rule\.fn: module 'math' has no function 'nope'"):
        RewardSource([], rule=FunctionRef(fn="math:nope"))


def _scoring(reward_model):
    model = LastTokenScorer()
    return ScoringModels(reward_model=reward_model, score_norm=(1.0, 2.0), reference=model, sft=model, gold=len)


def test_the_rounds_model_source_uses_the_rounds_reward_model_and_its_norm():
    reward = RewardConfig(sources=[RewardSourceConfig(name="rm", type="model", weight=3.0)])
    rm = LastTokenScorer()
    source = build_reward_source(reward, _scoring(rm), None, pool=None, runtime=None, model_cfg=None)
    assert source.names == ["rm"] and source.weights.tolist() == [3.0]
    assert source.learned == (LearnedSource("rm", 3.0, rm, (1.0, 2.0), 0.0, "critic/score_std_ensemble"),)
    assert start_reward_pool(reward) is None  # no rule or function source: no worker processes


def test_the_rounds_model_source_without_a_trained_reward_model_fails_naming_it():
    reward = RewardConfig(sources=[RewardSourceConfig(name="judge", type="model")])
    with pytest.raises(RewardSourceError, match="reward source 'judge' is the round's reward model, but none"):
        build_reward_source(reward, _scoring(None), None, pool=None, runtime=None, model_cfg=None)


def test_function_sources_are_weighted_after_the_learned_ones_and_collect_zeros_without_a_pool():
    reward = RewardConfig(
        sources=[
            RewardSourceConfig(name="len", type="length", weight=0.5, kwargs={"target": 3}),
            RewardSourceConfig(name="rm", type="model"),
        ]
    )
    source = build_reward_source(reward, _scoring(LastTokenScorer()), None, pool=None, runtime=None, model_cfg=None)
    assert source.names == ["rm", "len"] and source.weights.tolist() == [1.0, 0.5]
    assert source.submit(BATCH, RECORDS) is None
    assert source.collect(None, rows=3).shape == (3, 1)


class TwoHeads(torch.nn.Module):
    """An ensemble of two heads: the token id, and three times it."""

    def forward(self, input_ids, attention_mask):
        return input_ids.float()[..., None] * torch.tensor([1.0, 3.0])


def test_an_ensemble_source_is_rewarded_its_heads_mean_less_the_penalty_and_logs_their_spread():
    reward = RewardConfig(uncertainty_penalty=0.5)
    scoring = ScoringModels(TwoHeads(), ((0.0, 0.0), (1.0, 1.0)), LastTokenScorer(), LastTokenScorer(), len)
    source = build_reward_source(reward, scoring, None, pool=None, runtime=None, model_cfg=None)
    scores = source.model_scores(BATCH, rows=3, step=1)
    # Last tokens 4, 6, 8: heads (x, 3x), mean 2x, unbiased std sqrt(2) x; reward 2x - 0.5 sqrt(2) x.
    x = torch.tensor([4.0, 6.0, 8.0])
    assert torch.allclose(scores[:, 0], 2 * x - 0.5 * 2**0.5 * x)
    final = source.final_scores(scores, RECORDS, ["a", "b", "c"])
    assert torch.allclose(final, scores[:, 0])
    assert source.metrics["critic/score_std_ensemble"] == pytest.approx(2**0.5 * 6.0)
    assert source.metrics["reward/rm/mean"] == pytest.approx(float(scores.mean()))
    source.model_scores(BATCH, rows=3, step=2)  # the spread is the step's own: not carried over
    source.final_scores(scores, RECORDS, ["a", "b", "c"])
    assert source.metrics["critic/score_std_ensemble"] == pytest.approx(2**0.5 * 6.0)
    plain = build_reward_source(RewardConfig(), _scoring(LastTokenScorer()), None, None, None, None)
    plain.final_scores(plain.model_scores(BATCH, rows=3, step=1), RECORDS, ["a", "b", "c"])
    assert "critic/score_std_ensemble" not in plain.metrics  # one head: no spread to log


def test_the_declared_rule_is_built_as_the_pool_builds_its_source():
    valid = RewardSourceConfig(name="valid", type="format", weight=0.0, kwargs={"kind": "number"})
    reward = RewardConfig(sources=[RewardSourceConfig(name="rm", type="model"), valid], valid="valid")
    assert named_source(reward, reward.valid) is valid and named_source(reward, None) is None
    rule = source_scorer(named_source(reward, reward.valid), reward.on_error)
    assert [rule("p", r) for r in ("42", "forty-two", " 3.5 ")] == [1.0, 0.0, 1.0]
    assert source_scorer(None, "fail") is None
    # a reward model is no rule: the evaluation loads it
    assert source_scorer(named_source(reward, "rm"), "fail") is None
