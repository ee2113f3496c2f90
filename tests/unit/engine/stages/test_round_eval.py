"""The round's evaluation stage on the tiny demo model: its start and final policy on the same
prompts with the same seed, the paired differences (the judge's too), and the regression set."""

import json

import pytest
import torch

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import inputs, make_ctx, model, run
from rlflow.engine.config.promotion import PromotionConfig, PromotionGate
from rlflow.engine.config.schema import build_config
from rlflow.engine.data.batching import encode_pair
from rlflow.engine.errors import DataError
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.promotion.gates import decide_promotion
from rlflow.engine.stages.evaluation import PolicyEvaluation, response_nll_by_row
from rlflow.engine.stages.round_eval import (
    BY_PROMPT_TABLE,
    RESULTS_FILE,
    EvalUpstream,
    gold_by_prompt,
    paired_metrics,
    prompt_digest,
)


def evaluation(small_assets, tmp_path, start, final, gold, **data):
    """The eval stage's inputs: `start` and `final` policies (the tiny model as reference and SFT
    policy), gold `gold`, 6 new tokens sampled at temperature 1, and these data.* keys."""
    tree = small_config_tree(small_assets, tmp_path, sampling={"max_new_tokens": 6})
    tree["data"] |= data
    tree |= {"gold": {"fn": gold}, "eval": tree["eval"] | {"num_prompts": 6, "num_logged_samples": 3}}
    tiny = model(small_assets / "tiny-model")
    upstream = EvalUpstream(start=model(start), final=model(final), reference=tiny, sft=tiny)
    return inputs(build_config(tree, "t"), "eval", upstream)


def test_evaluation_measures_start_and_final_policy_on_the_same_prompts_and_seed(small_assets, tmp_path):
    policy = str(small_assets / "tiny-model")
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "eval", sink=sink)
    outcome = run(ctx, evaluation(small_assets, tmp_path, policy, policy, "helpers.reward_fns:response_length"))
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
    assert set(sink.tables) == {"eval_samples_before.json", "eval_samples_after.json", BY_PROMPT_TABLE}
    results = ctx.store.read_json(0, RESULTS_FILE)
    assert len(results["after"]["samples"]) == 3
    assert results["before"]["metrics"]["eval/gold_score"] == m["gold_score_before"]
    # each prompt's gold before and after, under its digest: what `rlflow compare` pairs two runs on
    rows = results["by_prompt"]
    assert sink.tables[BY_PROMPT_TABLE] == rows and len(rows) == 6 and len({r["prompt"] for r in rows}) == 6
    assert sum(r["gold_after"] for r in rows) / 6 == pytest.approx(m["gold_score_after"])
    assert all(r["gold_before"] == r["gold_after"] for r in rows)


def test_a_prompts_digest_names_its_token_ids_in_order():
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3)) and len(prompt_digest([1])) == 16
    assert len({prompt_digest(ids) for ids in ([1, 2, 3], [12, 3], [1, 23], [3, 2, 1])}) == 4
    before = PolicyEvaluation({}, [], (0.0, 1.0), (1.0, 1.0))
    after = PolicyEvaluation({}, [], (1.0, 1.0), (1.0, 1.0))
    assert gold_by_prompt([[5], [6, 7]], before, after) == [
        {"prompt": prompt_digest([5]), "gold_before": 0.0, "gold_after": 1.0},
        {"prompt": prompt_digest([6, 7]), "gold_before": 1.0, "gold_after": 1.0},
    ]
    with pytest.raises(ValueError):  # a score per prompt, or it is not a table of them
        gold_by_prompt([[5]], before, after)


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


def test_a_fixed_regression_set_is_scored_for_start_and_candidate_and_paired(small_assets, tmp_path):
    start = str(small_assets / "tiny-model")
    moved = tmp_path / "moved"
    policy = load_policy(start)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    policy.save_pretrained(moved)
    load_tokenizer(start).save_pretrained(moved)
    rows = [
        {"prompt": "describe the river .", "response": "the river is calm ."},
        {"prompt": "hi", "response": "hello"},
    ]
    regression = tmp_path / "regression.jsonl"
    regression.write_text("".join(json.dumps(r) + "\n" for r in rows))
    zero = "helpers.reward_fns:constant_rule"  # the gold plays no part here
    eval_inputs = evaluation(small_assets, tmp_path, start, moved, zero, regression=str(regression))
    m = run(make_ctx(tmp_path, "eval"), eval_inputs).metrics
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
        run(make_ctx(tmp_path / "again", "eval"), eval_inputs)
