"""Evaluating a policy on the tiny demo model: each metric against numbers recomputed from the same
draw: gold score and its standard error, the reward model's normalised score, KL (zero to itself),
length, valid fraction."""

import math

import pytest
import torch

from rlflow.engine.algorithms.stats import distinct_n
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.data.records import PromptRecord
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.stages.evaluation import evaluate_policy

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
RECORDS = [PromptRecord(p, {"bonus": i}) for i, p in enumerate(["1 + 1 =", "2 + 5 =", "hello", "3 x 3 ="])]


class LastTokenScorer(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids.float()


def gold(prompt, response, bonus):
    """0.1 per character, bonus on top; 'valid' when the answer is not empty."""
    return {"score": 0.1 * len(response) + bonus, "valid": float(bool(response.strip()))}


@pytest.fixture(scope="module")
def tiny(small_assets):
    model_dir = str(small_assets / "tiny-model")
    return load_policy(model_dir).eval(), load_tokenizer(model_dir)


def test_metrics_are_the_draws_own_numbers(tiny):
    policy, tokenizer = tiny
    prompts, _, _ = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    models = ScoringModels(LastTokenScorer(), (100.0, 50.0), reference=policy, sft=policy, gold=gold)
    evaluation = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=9, batch_size=8, n_samples=2)
    metrics, rows = evaluation.metrics, evaluation.samples

    # the same draw: one chunk of all four prompts, seeded seed + 0
    batch = generate_rollouts(policy, tokenizer, prompts.token_ids, SAMPLING, 9)
    texts = list(batch.response_texts)
    scores = [0.1 * len(t) + i for i, t in enumerate(texts)]
    mean = sum(scores) / 4
    stderr = math.sqrt(sum((s - mean) ** 2 for s in scores) / 3 / 4)
    last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.flip(1).argmax(1)
    rm = (batch.input_ids.gather(1, last[:, None]).squeeze(1).float() - 100.0) / 50.0
    assert metrics["eval/gold_score"] == pytest.approx(mean)
    assert metrics["eval/gold_score_stderr"] == pytest.approx(stderr)
    assert metrics["eval/rm_score"] == pytest.approx(float(rm.mean()))
    assert metrics["eval/kl"] == pytest.approx(0.0, abs=1e-6) and metrics["eval/kl_to_sft"] == pytest.approx(0, abs=1e-6)
    assert metrics["eval/response_length"] == pytest.approx(float(batch.response_mask.sum(1).mean()))
    assert metrics["eval/distinct_2"] == pytest.approx(distinct_n([t.split() for t in texts], 2))
    assert metrics["eval/valid_fraction"] == sum(bool(t.strip()) for t in texts) / 4
    assert metrics["eval/gold/valid"] == metrics["eval/valid_fraction"]
    assert [r["response"] for r in rows] == texts[:2] and rows[1]["gold_score"] == pytest.approx(scores[1])
    assert rows[0]["rm_score"] == pytest.approx(float(rm[0]))
    assert evaluation.gold_scores == pytest.approx(scores)
    assert evaluation.valid == tuple(float(bool(t.strip())) for t in texts)
    assert "eval/rm_score_std_ensemble" not in metrics  # one head: no spread


class TwoHeads(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids.float()[..., None] * torch.tensor([1.0, -1.0])


def test_an_ensembles_score_is_its_heads_mean_and_their_spread_is_logged(tiny):
    policy, tokenizer = tiny
    prompts, _, _ = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    models = ScoringModels(TwoHeads(), ((100.0, -100.0), (50.0, 25.0)), reference=policy, sft=policy, gold=gold)
    metrics = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=9, batch_size=8).metrics
    batch = generate_rollouts(policy, tokenizer, prompts.token_ids, SAMPLING, 9)
    last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.flip(1).argmax(1)
    x = batch.input_ids.gather(1, last[:, None]).squeeze(1).float()
    heads = torch.stack([(x - 100.0) / 50.0, (-x + 100.0) / 25.0], 1)  # each head by its own (mean, std)
    assert metrics["eval/rm_score"] == pytest.approx(float(heads.mean(1).mean()))
    assert metrics["eval/rm_score_std_ensemble"] == pytest.approx(float(heads.std(1).mean()))


def test_chunks_do_not_change_the_answers_only_their_seeds_spans(tiny):
    policy, tokenizer = tiny
    prompts, _, _ = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    models = ScoringModels(None, None, reference=policy, sft=policy, gold=gold)
    rows = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=9, batch_size=2, n_samples=4).samples
    # chunk [2, 4) is seeded 9 + 2
    second = generate_rollouts(policy, tokenizer, prompts.token_ids[2:], SAMPLING, 11)
    assert [r["response"] for r in rows[2:]] == list(second.response_texts)


def test_without_a_reward_model_there_is_no_rm_score_and_kl_to_another_policy_is_positive(tiny, small_assets):
    policy, tokenizer = tiny
    other = load_policy(str(small_assets / "tiny-model")).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    prompts, _, _ = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    models = ScoringModels(None, None, reference=policy, sft=other, gold=gold)
    evaluation = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=1, batch_size=8, n_samples=1)
    metrics, rows = evaluation.metrics, evaluation.samples
    assert "eval/rm_score" not in metrics and rows[0]["rm_score"] is None
    assert metrics["eval/kl"] == pytest.approx(0.0, abs=1e-6) and metrics["eval/kl_to_sft"] > 1e-4


def test_a_declared_valid_rule_replaces_the_golds_valid_component(tiny):
    policy, tokenizer = tiny
    prompts, _, _ = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    calls = []

    def longer_than_three(prompt, response, bonus):  # the prompt row's fields come too
        calls.append(bonus)
        return float(len(response) > 3)

    models = ScoringModels(None, None, reference=policy, sft=policy, gold=gold, valid=longer_than_three)
    evaluation = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=9, batch_size=8)
    texts = list(generate_rollouts(policy, tokenizer, prompts.token_ids, SAMPLING, 9).response_texts)
    assert evaluation.valid == tuple(float(len(t) > 3) for t in texts) and calls == [0, 1, 2, 3]
    assert evaluation.metrics["eval/valid_fraction"] == sum(len(t) > 3 for t in texts) / 4
    assert evaluation.metrics["eval/gold/valid"] == sum(bool(t.strip()) for t in texts) / 4  # the gold's, still logged


def test_a_judge_scores_every_answer_as_a_rule_or_as_a_second_reward_model(tiny):
    policy, tokenizer = tiny
    prompts, _, _ = encode_prompt_set(tokenizer, RECORDS, 64, "drop", "eval.jsonl")
    texts = list(generate_rollouts(policy, tokenizer, prompts.token_ids, SAMPLING, 9).response_texts)

    def words(prompt, response, bonus):
        return float(len(response.split()))

    models = ScoringModels(None, None, reference=policy, sft=policy, gold=gold, judge=words)
    by_rule = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=9, batch_size=8)
    assert by_rule.judge == tuple(float(len(t.split())) for t in texts)
    assert by_rule.metrics["eval/judge_score"] == pytest.approx(sum(len(t.split()) for t in texts) / 4)
    assert by_rule.rm_scores is None  # no reward model: nothing for the judge to agree with
    # A second reward model judges by its raw score: the last token's id here, as LastTokenScorer reads it
    models = ScoringModels(None, None, reference=policy, sft=policy, gold=gold, judge_model=LastTokenScorer())
    by_model = evaluate_policy(policy, tokenizer, prompts, models, SAMPLING, seed=9, batch_size=8)
    batch = generate_rollouts(policy, tokenizer, prompts.token_ids, SAMPLING, 9)
    last = [float(row[int(mask.sum()) - 1]) for row, mask in zip(batch.response_ids, batch.response_mask)]
    assert by_model.judge == pytest.approx(tuple(last)) and len(set(last)) > 1  # each answer its own score
    no_judge = evaluate_policy(policy, tokenizer, prompts, ScoringModels(None, None, policy, policy, gold), SAMPLING, 9)
    assert no_judge.judge is None and "eval/judge_score" not in no_judge.metrics


def test_each_rows_response_nll_is_its_own_heldout_loss_whatever_the_batch(tiny):
    from rlflow.engine.data.batching import encode_pair
    from rlflow.engine.stages.evaluation import response_nll_by_row
    from rlflow.engine.stages.sft import heldout_loss

    policy, tokenizer = tiny
    pairs = [("1 + 1 =", "2"), ("describe the river .", "the river is calm and wide ."), ("hello", "hi there")]
    rows = [encode_pair(tokenizer, p, r, 64) for p, r in pairs]
    pad = tokenizer.pad_token_id
    batched = response_nll_by_row(policy, rows, pad, batch_size=8)
    # heldout_loss of one row is that row's mean NLL per response token: an independent formula
    assert batched == pytest.approx([heldout_loss(policy, [row], pad) for row in rows], rel=1e-5)
    assert response_nll_by_row(policy, rows, pad, batch_size=1) == pytest.approx(batched, rel=1e-5)  # padding-free
    assert len(set(batched)) == 3 and min(batched) > 0
