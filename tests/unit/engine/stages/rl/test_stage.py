"""PPO on the small demo task: log-prob recomputation matches sampling, PPO raises the reward,
the gold function is never called by training, and the KL stop ends a round early."""

import math

import pytest
import torch

from conftest import RecordingSink, assert_weights_agree, rl_inputs, small_config_tree
from helpers.stage_ctx import make_ctx
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.stages.evaluation import encode_prompt_set, evaluate_policy
from rlflow.engine.data.records import load_prompts
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.models.loading import load_policy, load_tokenizer, token_logprobs
from rlflow.engine.stages.rl.step import make_controller, ppo_step, single_pass_possible
from rlflow.engine.stages.rl.experience import Objective
from rlflow.engine.stages.rl.stage import PPOInputs, load_ppo_models, run_ppo_stage
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import batched_logprobs, generate_rollouts, sample_tokens


def boom(*args, **kwargs):
    raise AssertionError("the gold function must not be called by PPO training")


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


def _models(trained, gold, cfg=None):
    sft_dir, rm_dir, norm = trained
    cfg = cfg or build_config({}, "t")
    return load_ppo_models(
        PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir), cfg.model, cfg.ppo, gold, Runtime()
    )


def test_ppo_step_never_calls_gold_but_evaluation_does(trained, small_assets, tmp_path):
    cfg = build_config(small_config_tree(small_assets, tmp_path), "t")
    models = _models(trained, boom)
    prompts, _, _ = encode_prompt_set(models.tokenizer, load_prompts(cfg.data.prompts), 32, "truncate", "prompts")
    metrics = ppo_step(models, make_controller(cfg.kl), cfg.ppo, prompts, 0, 0, 1, 32, Objective.of(cfg))
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
            ppo={"steps": 8, "rollout_batch": 32, "mini_batch": 16, "epochs": 2, "actor_lr": 1e-3},
            kl={"stop_above": None, "coef": 0.01, "controller": "fixed"},
        ),
        "t",
    )
    sink = RecordingSink()
    inputs = PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir)
    outcome = run_ppo_stage(make_ctx(tmp_path, "ppo", sink=sink, every=4), rl_inputs(cfg, inputs, boom_free_gold))
    models = _models(trained, boom_free_gold)
    prompts, _, _ = encode_prompt_set(models.tokenizer, load_prompts(cfg.data.eval_prompts), 32, "truncate", "prompts")
    sampling = cfg.sampling.params()
    before = evaluate_policy(models.actor.model, models.tokenizer, prompts, models.scoring, sampling, seed=1).metrics
    after = evaluate_policy(
        load_policy(f"{outcome.checkpoint_uri}/model"), models.tokenizer, prompts, models.scoring, sampling, seed=1
    ).metrics
    assert after["eval/rm_score"] - before["eval/rm_score"] >= 0.3
    assert [s for s, _ in sink.series("actor/pg_loss")] == list(range(1, 9))
    assert outcome.metrics["ppo/steps"] == 8


def boom_free_gold(prompt, response, **fields):
    return 0.0


def test_stop_kl_ends_the_round_early(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(small_assets, tmp_path, ppo={"steps": 6, "actor_lr": 1e-3}, kl={"stop_above": 1e-6}), "t"
    )
    inputs = PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir)
    outcome = run_ppo_stage(make_ctx(tmp_path, "ppo"), rl_inputs(cfg, inputs, boom_free_gold))
    # Step 1 samples from the reference itself (KL 0); after one update the KL passes 1e-6.
    assert outcome.metrics["ppo/stopped_by_kl"] == 1.0 and outcome.metrics["ppo/steps"] == 2


def test_keep_best_protects_the_best_evaluated_step_from_pruning(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(
            small_assets,
            tmp_path,
            ppo={"steps": 4, "actor_lr": 1e-3},
            eval={"every_steps": 1, "num_prompts": 16},
            checkpoint={"keep_best": "eval/kl", "keep_best_mode": "min"},
        ),
        "t",
    )
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "ppo", sink=sink, every=100, keep_last=1)
    inputs = PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir)
    run_ppo_stage(ctx, rl_inputs(cfg, inputs, boom_free_gold))
    kls = dict(sink.series("eval/kl"))
    best = min(kls, key=kls.get)
    assert sorted(kls) == [1, 2, 3, 4] and best < 4  # KL grows as PPO moves away from the reference
    assert ctx.store.committed_steps() == sorted({best, 4})
    assert ctx.store.manifest(4)["meta"]["ppo_state"]["best_step"] == best


def test_critic_warmup_updates_only_the_critic(trained, small_assets, tmp_path):
    cfg = build_config(small_config_tree(small_assets, tmp_path, ppo={"critic_warmup_steps": 1}), "t")
    models = _models(trained, boom, cfg)
    prompts, _, _ = encode_prompt_set(models.tokenizer, load_prompts(cfg.data.prompts), 32, "truncate", "prompts")
    actor, critic = models.actor.model, models.critic.model
    actor_before = {k: v.clone() for k, v in actor.state_dict().items()}
    critic_before = {k: v.clone() for k, v in critic.state_dict().items()}
    controller = make_controller(cfg.kl)
    warm = ppo_step(models, controller, cfg.ppo, prompts, 0, 0, 1, 32, Objective.of(cfg))
    assert "actor/pg_loss" not in warm and "critic/vf_loss" in warm and warm["timing_s/update_critic"] > 0
    assert all(torch.equal(v, actor.state_dict()[k]) for k, v in actor_before.items())
    assert not all(torch.equal(v, critic.state_dict()[k]) for k, v in critic_before.items())
    after = ppo_step(models, controller, cfg.ppo, prompts, 0, 0, 2, 32, Objective.of(cfg))
    assert "actor/pg_loss" in after
    assert not all(torch.equal(v, actor.state_dict()[k]) for k, v in actor_before.items())


def test_single_pass_update_equals_scoring_then_updating(trained, small_assets, tmp_path):
    """One epoch over one mini-batch: the update's own forwards stand in for the old-log-prob and
    value passes. Against the same step with the passes (forced by two micro-batches): the same
    draw, the same metrics, the same weights after the step."""
    cfg = build_config(
        small_config_tree(small_assets, tmp_path, ppo={"rollout_batch": 16, "mini_batch": 16, "epochs": 1}), "t"
    )
    sft_dir, rm_dir, norm = trained
    runs = {}
    for micro in (None, 8):
        models = load_ppo_models(
            PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir),
            cfg.model,
            cfg.ppo,
            boom,
            Runtime(EngineConfig(micro_batch_size=micro)),
        )
        assert single_pass_possible(models, cfg.ppo, update_actor=True) == (micro is None)
        prompts, _, _ = encode_prompt_set(models.tokenizer, load_prompts(cfg.data.prompts), 32, "truncate", "prompts")
        metrics = ppo_step(models, make_controller(cfg.kl), cfg.ppo, prompts, 0, 0, 1, 16, Objective.of(cfg))
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
    from rlflow.engine.stages.reward_model import run_reward_model_stage, score_norm_from_metrics

    sft_dir = trained[0]
    sections = {"rm": {"epochs": 1, "ensemble": 3}, "ppo": {"steps": 1, "rollout_batch": 16, "mini_batch": 8}}
    cfg = build_config(small_config_tree(small_assets, tmp_path, **sections), "t")
    rm = run_reward_model_stage(make_ctx(tmp_path / "rm", "rm"), rm_inputs(cfg, sft_dir))
    rm_dir, norm = f"{rm.checkpoint_uri}/model", score_norm_from_metrics(rm.metrics)
    inputs = PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir)  # critic_init=rm: the heads' mean

    def first_step(penalty):
        sink = RecordingSink()
        reward = cfg.reward.model_copy(update={"uncertainty_penalty": penalty})
        ctx = make_ctx(tmp_path / f"ppo-{penalty}", "ppo", sink=sink)
        run_ppo_stage(ctx, rl_inputs(cfg, inputs, boom_free_gold, reward=reward))
        return {k: sink.series(k)[0][1] for k in ("reward/rm/mean", "critic/score_std_ensemble", "critic/vf_loss")}

    plain, penalised = first_step(0.0), first_step(2.0)
    # Step 1 samples the same answers either way: the mean reward differs by lambda x the mean spread.
    assert plain["critic/score_std_ensemble"] == pytest.approx(penalised["critic/score_std_ensemble"])
    assert plain["critic/score_std_ensemble"] > 0
    expected = plain["reward/rm/mean"] - 2.0 * plain["critic/score_std_ensemble"]
    assert penalised["reward/rm/mean"] == pytest.approx(expected, rel=1e-5)
    assert math.isfinite(plain["critic/vf_loss"])
