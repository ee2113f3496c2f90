"""PPO on the small demo task: log-prob recomputation matches sampling, PPO raises the reward,
the gold function is never called by training, and the KL stop ends a round early. Steps are
opened by the RL-run entry point, as the stage opens them."""

import math

import pytest
import torch

from conftest import RecordingSink, assert_weights_agree, rl_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.stages.evaluation import evaluate_policy
from rlflow.engine.data.records import load_prompts
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.models.loading import load_policy, load_tokenizer, token_logprobs
from rlflow.engine.stages.guard import StageGuard
from rlflow.engine.stages.loop import StageStart
from rlflow.engine.stages.rl.run import RLRun
from rlflow.engine.stages.rl.stage import run_rl_stage
from rlflow.engine.stages.rl.step import single_pass_possible
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import batched_logprobs, generate_rollouts, sample_tokens


NEVER = {"fn": "helpers.reward_fns:never_called"}  # a gold score that raises when called
ZERO = {"fn": "helpers.reward_fns:zero"}


def test_recomputed_logprobs_match_the_sampler_and_first_ratio_is_one(trained):
    sft_dir, _, _ = trained
    tokenizer, policy = load_tokenizer(sft_dir), load_policy(sft_dir)
    texts = ["describe the river .", "what is the old stone garden like ?", "tell me about the city ."]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len({len(p) for p in prompts}) == 3  # unequal lengths: left padding differs per row
    batch = generate_rollouts(policy, tokenizer, prompts, SamplingParams(temperature=0.7, max_new_tokens=10), seed=3)
    old = batched_logprobs(policy, batch, temperature=0.7)
    # The sampler's own distribution (logits / T) for the tokens it drew, as the sampler reports it.
    ids, attention = batch.input_ids[:, : batch.prompt_width], batch.attention_mask[:, : batch.prompt_width]
    stops, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    out = sample_tokens(policy, ids, attention, SamplingParams(0.7, 1.0, 10), stops, pad, 3)
    mask = batch.response_mask
    assert torch.equal(torch.where(mask.bool(), out.tokens, pad), batch.response_ids)
    assert torch.allclose(out.logprobs * mask, old * mask, atol=1e-5)
    # First PPO mini-batch: a subset of rows recomputed in train mode gives ratio 1.
    policy.train()
    index = torch.tensor([2, 0])
    sub = batch.rows(index)
    new, _ = token_logprobs(policy, sub.input_ids, sub.attention_mask, sub.prompt_width, 0.7)
    ratio = torch.exp(new - old[index]) * sub.response_mask + (1 - sub.response_mask)
    assert (ratio - 1).abs().max().item() < 1e-6


def _open(trained, cfg, runtime=None) -> RLRun:
    """PPO from the trained SFT policy, with the trained reward model as reward and critic start."""
    sft_dir, rm_dir, norm = trained
    return RLRun.open(runtime or Runtime(), rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir))


def test_ppo_step_never_calls_gold_but_evaluation_does(trained, small_assets, tmp_path):
    cfg = build_config(small_config_tree(small_assets, tmp_path, gold=NEVER), "t")
    with _open(trained, cfg) as rl_run:
        metrics = rl_run.step(1)
    models, prompts = rl_run.models, rl_run.prompts
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_coef",
        "actor/grad_norm",
        "critic/vf_loss",
        "critic/vf_explained_var",
        "critic/score/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "perf/throughput",
    ):
        assert math.isfinite(metrics[key]), key
    calls = []
    counting = ScoringModels(
        *[getattr(models.scoring, f) for f in ("reward_model", "score_norm", "reference", "sft")],
        gold=lambda p, r, **kw: calls.append(r) or 0.5,
    )
    few = type(prompts)(prompts.records[:8], prompts.token_ids[:8])
    result = evaluate_policy(
        models.actor.model, models.tokenizer, few, counting, SamplingParams(max_new_tokens=8), seed=0, n_samples=3
    )
    assert len(calls) == 8 and result.metrics["eval/gold_score"] == pytest.approx(0.5) and len(result.samples) == 3
    assert result.gold_scores == (0.5,) * 8


def test_ppo_raises_reward_model_score(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(
            small_assets,
            tmp_path,
            rl={"steps": 8, "rollout_batch": 32, "mini_batch": 16, "epochs": 2, "actor_lr": 1e-3},
            kl={"stop_above": None, "coef": 0.01, "controller": "fixed"},
            gold=ZERO,
        ),
        "t",
    )
    sink = RecordingSink()
    outcome = run(make_ctx(tmp_path, "rl", sink=sink, every=4), rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir))
    with _open(trained, cfg) as rl_run:  # the starting policy, its tokenizer and scoring models
        models = rl_run.models
    prompts, _, _ = encode_prompt_set(models.tokenizer, load_prompts(cfg.data.eval_prompts), 32, "truncate", "prompts")
    sampling = cfg.sampling.params()
    before = evaluate_policy(models.actor.model, models.tokenizer, prompts, models.scoring, sampling, seed=1).metrics
    after = evaluate_policy(
        load_policy(f"{outcome.checkpoint_uri}/model"), models.tokenizer, prompts, models.scoring, sampling, seed=1
    ).metrics
    assert after["eval/rm_score"] - before["eval/rm_score"] >= 0.3
    assert [s for s, _ in sink.series("actor/pg_loss")] == list(range(1, 9))
    assert outcome.metrics["rl/steps"] == 8


def test_stop_kl_ends_the_round_early(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(small_assets, tmp_path, rl={"steps": 6, "actor_lr": 1e-3}, kl={"stop_above": 1e-6}), "t"
    )
    outcome = run(make_ctx(tmp_path, "rl"), rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir))
    # Step 1 samples from the reference itself (KL 0); after one update the KL passes 1e-6.
    assert outcome.metrics["rl/stopped_by_kl"] == 1.0 and outcome.metrics["rl/steps"] == 2


def test_keep_best_protects_the_best_evaluated_step_from_pruning(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(
            small_assets,
            tmp_path,
            rl={"steps": 4, "actor_lr": 1e-3},
            eval={"every_steps": 1, "num_prompts": 16},
            checkpoint={"keep_best": "eval/kl", "keep_best_mode": "min"},
        ),
        "t",
    )
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "rl", sink=sink, every=100, keep_last=1)
    # The stage's body itself, started fresh (what the catalog's run_stage does for a new stage).
    run_rl_stage(ctx, rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir), StageStart(None, (), StageGuard(ctx, None)))
    kls = dict(sink.series("eval/kl"))
    best = min(kls, key=kls.get)
    assert sorted(kls) == [1, 2, 3, 4] and best < 4  # KL grows as PPO moves away from the reference
    assert ctx.store.committed_steps() == sorted({best, 4})
    assert ctx.store.manifest(4)["meta"]["rl_state"]["best_step"] == best


def test_critic_warmup_updates_only_the_critic(trained, small_assets, tmp_path):
    cfg = build_config(small_config_tree(small_assets, tmp_path, ppo={"critic_warmup_steps": 1}, gold=NEVER), "t")
    rl_run = _open(trained, cfg)
    actor, critic = rl_run.models.actor.model, rl_run.models.critic.model
    actor_before = {k: v.clone() for k, v in actor.state_dict().items()}
    critic_before = {k: v.clone() for k, v in critic.state_dict().items()}
    warm = rl_run.step(1)
    assert "actor/pg_loss" not in warm and "critic/vf_loss" in warm and warm["timing_s/update_critic"] > 0
    assert all(torch.equal(v, actor.state_dict()[k]) for k, v in actor_before.items())
    assert not all(torch.equal(v, critic.state_dict()[k]) for k, v in critic_before.items())
    after = rl_run.step(2)
    rl_run.close()
    assert "actor/pg_loss" in after
    assert not all(torch.equal(v, actor.state_dict()[k]) for k, v in actor_before.items())


def test_single_pass_update_equals_scoring_then_updating(trained, small_assets, tmp_path):
    """One epoch over one mini-batch: the update's own forwards stand in for the old-log-prob and
    value passes. Against the same step with the passes (forced by two micro-batches): the same
    draw, the same metrics, the same weights after the step."""
    rl = {"rollout_batch": 16, "mini_batch": 16, "epochs": 1}
    tree = small_config_tree(small_assets, tmp_path, rl=rl, gold=NEVER)
    cfg = build_config(tree | {"rollout": {"generate_batch": 16}}, "t")
    runs = {}
    for micro in (None, 8):
        with _open(trained, cfg, Runtime(EngineConfig(micro_batch_size=micro))) as rl_run:
            models = rl_run.models
            assert single_pass_possible(models, cfg.rl, update_actor=True) == (micro is None)
            metrics = rl_run.step(1)
        runs[micro] = metrics, models.actor.model.state_dict(), models.critic.model.state_dict()
    (single, actor_1, critic_1), (split, actor_2, critic_2) = runs[None], runs[8]
    assert "timing_s/old_logprobs" not in single and split["timing_s/old_logprobs"] > 0
    assert single["rollout/response_ids_crc32"] == split["rollout/response_ids_crc32"]
    assert single["actor/ppo_kl"] == 0.0 and abs(split["actor/ppo_kl"]) < 1e-6  # ratio 1 at the first update
    for key in (
        "actor/kl",
        "actor/pg_loss",
        "actor/grad_norm",
        "critic/vf_loss",
        "critic/grad_norm",
        "critic/values/mean",
    ):
        assert single[key] == pytest.approx(split[key], rel=1e-4, abs=1e-6), key
    assert_weights_agree(actor_1, actor_2, 1e-5)
    assert_weights_agree(critic_1, critic_2, 1e-5)


def test_an_ensemble_reward_is_penalised_by_its_spread_and_starts_a_one_head_critic(trained, small_assets, tmp_path):
    from conftest import rm_inputs
    from rlflow.engine.stages.reward_model import score_norm_from_metrics

    sft_dir = trained[0]
    sections = {"rm": {"epochs": 1, "ensemble": 3}, "rl": {"steps": 1, "rollout_batch": 16, "mini_batch": 8}}
    cfg = build_config(small_config_tree(small_assets, tmp_path, **sections), "t")
    rm = run(make_ctx(tmp_path / "rm", "rm"), rm_inputs(cfg, sft_dir))
    rm_dir, norm = f"{rm.checkpoint_uri}/model", score_norm_from_metrics(rm.metrics)

    def first_step(penalty):
        sink = RecordingSink()
        penalised = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"uncertainty_penalty": penalty})})
        ctx = make_ctx(tmp_path / f"rl-{penalty}", "rl", sink=sink)
        run(ctx, rl_inputs(penalised, sft_dir, rm_dir, norm, critic=rm_dir))  # critic_init=rm: the heads' mean
        return {k: sink.series(k)[0][1] for k in ("reward/rm/mean", "critic/score_std_ensemble", "critic/vf_loss")}

    plain, penalised = first_step(0.0), first_step(2.0)
    # Step 1 samples the same answers either way: the mean reward differs by lambda x the mean spread.
    assert plain["critic/score_std_ensemble"] == pytest.approx(penalised["critic/score_std_ensemble"])
    assert plain["critic/score_std_ensemble"] > 0
    expected = plain["reward/rm/mean"] - 2.0 * plain["critic/score_std_ensemble"]
    assert penalised["reward/rm/mean"] == pytest.approx(expected, rel=1e-5)
    assert math.isfinite(plain["critic/vf_loss"])
