"""The short stages on the tiny demo model: answer pairs (a function of seed and round), online
labelling (chosen and rejected as the labeller said, ties and empty answers dropped, a held-out
share), and the round's evaluation of its start and final policy."""

import json

import pytest
import torch

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import make_ctx
from rlflow.engine.config.promotion import PromotionConfig, PromotionGate
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.promotion.gates import decide_promotion
from rlflow.engine.config.schema import build_config
from rlflow.engine.data.batching import encode_pair
from rlflow.engine.errors import DataError
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.stages.evaluation import PolicyEvaluation, response_nll_by_row
from rlflow.engine.stages.label_eval import (
    PAIRS_EVAL_FILE,
    PAIRS_FILE,
    RESULTS_FILE,
    EvalInputs,
    EvalStageInputs,
    LabelStageInputs,
    paired_metrics,
    run_eval_stage,
    run_label_stage,
    sample_answer_pairs,
)

SAMPLING = SamplingParams(1.0, 1.0, 6)


@pytest.fixture
def cfg(small_assets, tmp_path):
    return build_config(small_config_tree(small_assets, tmp_path), "t")


def longer(prompt, a, b, rng, **fields):
    """Prefers the longer answer; a tie when both are as long."""
    return None if len(a) == len(b) else 0 if len(a) > len(b) else 1


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_answer_pairs_are_a_function_of_seed_and_round(cfg, small_assets):
    policy = str(small_assets / "tiny-model")
    pairs = sample_answer_pairs(policy, cfg.model, cfg.data, SAMPLING, 6, seed=3, round_index=0)
    assert len(pairs) == 6
    assert pairs == sample_answer_pairs(policy, cfg.model, cfg.data, SAMPLING, 6, seed=3, round_index=0)
    other = sample_answer_pairs(policy, cfg.model, cfg.data, SAMPLING, 6, seed=3, round_index=1)
    assert [p[0].prompt for p in other] != [p[0].prompt for p in pairs]
    assert any(a != b for _, a, b in pairs)  # two draws, not one answer twice


def test_labelled_pairs_follow_the_labeller_and_count_what_was_dropped(cfg, small_assets, tmp_path):
    inputs = LabelStageInputs(str(small_assets / "tiny-model"), cfg.model, cfg.data, SAMPLING, longer, {}, 24, 0.25)
    ctx = make_ctx(tmp_path, "label", sink=RecordingSink())
    outcome = run_label_stage(ctx, inputs)
    train = read_jsonl(f"{outcome.checkpoint_uri}/{PAIRS_FILE}")
    held = read_jsonl(f"{outcome.checkpoint_uri}/{PAIRS_EVAL_FILE}")
    m = outcome.metrics
    assert (m["label/pairs"], m["label/pairs_eval"]) == (len(train), len(held))
    assert len(train) + len(held) + m["label/ties_dropped"] + m["label/empty_dropped"] == 24
    assert len(held) == round(0.25 * (len(train) + len(held)))
    assert all(len(r["chosen"]) > len(r["rejected"]) and r["rejected"].strip() for r in train + held)
    assert ctx.sink.metrics == [(0, m)]
    again = run_label_stage(make_ctx(tmp_path, "label"), inputs)  # the stage's final marker: not run twice
    assert again.skipped and again.metrics == m


def test_without_a_held_out_share_no_eval_file_is_written(cfg, small_assets, tmp_path):
    inputs = LabelStageInputs(str(small_assets / "tiny-model"), cfg.model, cfg.data, SAMPLING, longer, {}, 8)
    outcome = run_label_stage(make_ctx(tmp_path, "label"), inputs)
    assert "label/pairs_eval" not in outcome.metrics
    with pytest.raises(FileNotFoundError):
        read_jsonl(f"{outcome.checkpoint_uri}/{PAIRS_EVAL_FILE}")


def test_evaluation_measures_start_and_final_policy_on_the_same_prompts_and_seed(cfg, small_assets, tmp_path):
    policy = str(small_assets / "tiny-model")
    paths = EvalInputs(policy, policy, policy, policy, reward_model=None, score_norm=None)

    def gold(prompt, response, **fields):
        return float(len(response))

    eval_cfg = cfg.eval.model_copy(update={"num_prompts": 6, "num_logged_samples": 3})
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "eval", sink=sink)
    outcome = run_eval_stage(ctx, EvalStageInputs(paths, cfg.model, cfg.data, eval_cfg, SAMPLING, gold))
    m = outcome.metrics
    # the same policy twice, the same seed: the same answers, so every number agrees
    assert m["gold_score_before"] == m["gold_score_after"] and m["kl_before"] == pytest.approx(0.0, abs=1e-6)
    assert "rm_score_after" not in m
    assert [step for step, _ in sink.metrics] == [0, 1, 1]  # before, after, the paired change
    paired = {k: m[k] for k in ("gold_gain", "gold_gain_stderr", "valid_drop", "valid_drop_stderr")}
    assert paired == {"gold_gain": 0.0, "gold_gain_stderr": 0.0, "valid_drop": 0.0, "valid_drop_stderr": 0.0}
    # so two identical candidates are never rejected: no false reject under the default gates or z-gates
    row = {k.removesuffix("_after"): v for k, v in m.items()} | {"kl": 0.0, "gold_score_after": m["gold_score_after"]}
    gates = [*PromotionConfig().gates, PromotionGate(metric="valid_drop_z", max=2.0)]
    assert decide_promotion(row, gates + [PromotionGate(metric="gold_gain_z", min=0.0)]).promoted
    assert set(sink.tables) == {"eval_samples_before.json", "eval_samples_after.json"}
    results = ctx.store.read_json(0, RESULTS_FILE)
    assert len(results["after"]["samples"]) == 3
    assert results["before"]["metrics"]["eval/gold_score"] == m["gold_score_before"]


def test_the_judges_gain_and_its_agreement_with_the_reward_model_are_paired_by_prompt():
    def measured(gold, judge, rm):
        return PolicyEvaluation({}, [], tuple(gold), (1.0,) * len(gold), tuple(judge), tuple(rm))

    # prompt:      0     1     2     3
    before = measured([0, 0, 0, 0], judge=[1.0, 1.0, 2.0, 0.5], rm=[0.0, 0.0, 0.0, 1.0])
    after = measured([0, 0, 0, 0], judge=[2.0, 0.0, 2.0, 0.0], rm=[1.0, 2.0, 3.0, 0.0])
    m = paired_metrics(before, after)
    # judge changes +1, -1, 0, -0.5: mean -0.125, standard error of those four differences
    diffs = [1.0, -1.0, 0.0, -0.5]
    se = (sum((d + 0.125) ** 2 for d in diffs) / 3 / 4) ** 0.5
    assert m["eval/judge_gain"] == pytest.approx(-0.125) and m["eval/judge_gain_stderr"] == pytest.approx(se)
    # rm changes +1, +2, +3, -1: prompt 2 the judge does not tell apart; 0 and 3 agree, 1 does not
    assert m["eval/judge_agreement"] == pytest.approx(2 / 3) and m["eval/judge_agreement_n"] == 3
    no_rm = measured([0] * 4, [0.0] * 4, [0.0] * 4)
    no_rm = PolicyEvaluation({}, [], no_rm.gold_scores, no_rm.valid, no_rm.judge, None)
    alone = paired_metrics(no_rm, no_rm)
    assert "eval/judge_agreement" not in alone and alone["eval/judge_gain"] == 0.0
    no_judge = PolicyEvaluation({}, [], (0.0,), (1.0,))
    plain = {"eval/gold_gain", "eval/gold_gain_stderr", "eval/valid_drop", "eval/valid_drop_stderr"}
    assert set(paired_metrics(no_judge, no_judge)) == plain


def test_a_fixed_regression_set_is_scored_for_start_and_candidate_and_paired(cfg, small_assets, tmp_path):
    start = str(small_assets / "tiny-model")
    moved = tmp_path / "moved"
    model = load_policy(start)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    model.save_pretrained(moved)
    load_tokenizer(start).save_pretrained(moved)
    rows = [{"prompt": "describe the river .", "response": "the river is calm ."}, {"prompt": "hi", "response": "hello"}]
    regression = tmp_path / "regression.jsonl"
    regression.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = cfg.data.model_copy(update={"regression": str(regression)})
    eval_cfg = cfg.eval.model_copy(update={"num_prompts": 4})
    paths = EvalInputs(start, str(moved), start, start, reward_model=None, score_norm=None)
    inputs = EvalStageInputs(paths, cfg.model, data, eval_cfg, SAMPLING, lambda prompt, response, **f: 0.0)
    m = run_eval_stage(make_ctx(tmp_path, "eval"), inputs).metrics
    tokenizer = load_tokenizer(start)
    encoded = [encode_pair(tokenizer, r["prompt"], r["response"], 1024) for r in rows]
    per_row = {p: response_nll_by_row(load_policy(p), encoded, tokenizer.pad_token_id) for p in (start, str(moved))}
    assert m["regression_nll_before"] == pytest.approx(sum(per_row[start]) / 2, rel=1e-5)
    assert m["regression_nll_after"] == pytest.approx(sum(per_row[str(moved)]) / 2, rel=1e-5)
    diffs = [a - b for a, b in zip(per_row[str(moved)], per_row[start])]
    assert m["regression_nll_increase"] == pytest.approx(sum(diffs) / 2, rel=1e-4)
    assert m["regression_nll_increase_stderr"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2, rel=1e-4)
    regression.write_text("")
    with pytest.raises(DataError, match=r"regression.jsonl contains no records"):
        run_eval_stage(make_ctx(tmp_path / "again", "eval"), inputs)
