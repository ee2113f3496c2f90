"""GRPO, RLOO and REINFORCE++ through the RL stage: critic-free, groups of samples, the KL in the
reward or in the loss, and losses that do not depend on how a batch is cut into micro-batches."""

import math

import pytest
import torch

from conftest import RecordingSink, assert_weights_agree, rl_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.errors import RewardFunctionError
from rlflow.engine.stages.rl.run import RLRun


def _config(small_assets, tmp_path, name, n=2, algorithm=None, **rl):
    rl = {"rollout_batch": 8, "mini_batch": 4, "epochs": 1, "actor_lr": 1e-3} | rl
    tree = small_config_tree(small_assets, tmp_path, rl=rl, kl={"loss_coef": 0.1}, sampling={"max_new_tokens": 12})
    tree |= {"algorithm": {"name": name} | (algorithm or {}), "rollout": {"n": n, "generate_batch": 16}}
    return build_config(tree, "t")


def _step(trained, cfg, runtime):
    """Step 1 of the RL stage `cfg` describes, opened by the RL-run entry point: (its models, metrics,
    prompts)."""
    sft_dir, rm_dir, norm = trained
    critic = None if cfg.algorithm.critic_free else rm_dir
    with RLRun.open(runtime, rl_inputs(cfg, sft_dir, rm_dir, norm, critic=critic)) as rl_run:
        metrics = rl_run.step(1)
        return rl_run.models, metrics, rl_run.prompts


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_grpo_step_does_not_depend_on_the_micro_batch_size(trained, small_assets, tmp_path, loss_agg):
    cfg = _config(small_assets, tmp_path, "grpo", loss_agg=loss_agg)
    whole, m1, _ = _step(trained, cfg, Runtime())
    cut, m2, _ = _step(trained, cfg, Runtime(EngineConfig(micro_batch_size=3)))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m2[key] == pytest.approx(m1[key], abs=1e-6, rel=1e-5), key
    assert_weights_agree(whole.actor.model.state_dict(), cut.actor.model.state_dict(), 1e-5)


def _weights(models):
    return {k: v.clone() for k, v in models.actor.model.state_dict().items()}


def test_policy_losses_equal_ppo_at_ratio_one_and_differ_off_it(trained, small_assets, tmp_path):
    """One epoch over one mini-batch trains at ratio 1, where PPO, GSPO and CISPO have one gradient
    (the same update, to float rounding); with two mini-batches the second trains off ratio 1, and
    the variants part (the configured loss is the one that runs)."""
    on, off = {}, {}
    for loss in ("ppo", "gspo", "cispo"):
        single = _config(small_assets, tmp_path, "grpo", algorithm={"policy_loss": loss}, mini_batch=8)
        on[loss] = _weights(_step(trained, single, Runtime())[0])
        # gspo clipped at its own scale, the others at DAPO's decoupled bounds
        clip = {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4} if loss == "gspo" else {"clip_ratio_high": 0.28}
        two = _config(small_assets, tmp_path, "grpo", algorithm={"policy_loss": loss}, epochs=2, **clip)
        models, metrics, _ = _step(trained, two, Runtime())
        off[loss] = _weights(models)
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"]), loss
    for loss in ("gspo", "cispo"):
        assert_weights_agree(on["ppo"], on[loss], 1e-5)
        gap = max(float((off["ppo"][k] - off[loss][k]).abs().max()) for k in off["ppo"])
        assert gap > 1e-6, loss


def test_truncated_rollout_correction_of_an_exact_sampler_is_one(trained, small_assets, tmp_path):
    """The colocated sampler is the trainer's own policy: its log-probs match the trainer's to
    float rounding, so TIS weighs every token ~1 and the step is the uncorrected one."""
    plain = _config(small_assets, tmp_path, "grpo")
    corrected = _config(small_assets, tmp_path, "grpo", algorithm={"rollout_correction": "tis"})
    base, m0, _ = _step(trained, plain, Runtime())
    models, m1, _ = _step(trained, corrected, Runtime())
    for metrics in (m0, m1):  # logged with or without a correction
        assert abs(metrics["rollout/is_weight_mean"] - 1.0) < 1e-6
        assert abs(metrics["rollout/is_weight_max"] - 1.0) < 1e-5
        assert 0.0 <= metrics["rollout/mismatch_kl"] < 1e-9
        assert metrics["rollout/masked_fraction"] == metrics["rollout/capped_fraction"] == 0.0
    assert m1["rollout/response_ids_crc32"] == m0["rollout/response_ids_crc32"]
    assert_weights_agree(_weights(base), _weights(models), 1e-5)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_step_samples_groups_and_trains_only_the_actor(trained, small_assets, tmp_path, name):
    cfg = _config(small_assets, tmp_path, name, n=4, rollout_batch=4, mini_batch=2)
    models, metrics, _ = _step(trained, cfg, Runtime())
    assert models.critic is None
    assert not any(k.startswith("critic/v") for k in metrics)  # no critic: no values, no value loss
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl", "critic/score/mean", "reward/rm/mean"):
        assert math.isfinite(metrics[key]), key
    # The KL goes into the loss for GRPO (kl.loss_coef reported as the coefficient), into the reward otherwise.
    assert ("actor/kl_loss" in metrics) == (name == "grpo")
    assert metrics["actor/kl_coef"] == (0.1 if name == "grpo" else cfg.kl.coef)
    assert metrics["reward/rm/mean"] == pytest.approx(metrics["critic/score/mean"], abs=1e-6)


def test_group_advantages_are_centred_per_prompt(trained, small_assets, tmp_path, monkeypatch):
    """RLOO's advantages of one prompt's samples sum to zero: each prompt really got its own group."""
    import rlflow.engine.stages.rl.run as run_module
    import rlflow.engine.stages.rl.step as step_module

    cfg = _config(small_assets, tmp_path, "rloo", n=4, rollout_batch=4, mini_batch=4)
    seen = []
    original = run_module.assemble_experience
    for module in (run_module, step_module):  # the two-pass update, and the single pass
        monkeypatch.setattr(module, "assemble_experience", lambda *a, **k: seen.append(original(*a, **k)) or seen[-1])
    _step(trained, cfg, Runtime())
    exp = seen[-1]
    per_row = exp.advantages[:, 0]  # the same on every token of a row
    assert per_row.shape == (16,) and per_row.abs().sum() > 0
    assert torch.allclose(per_row.reshape(4, 4).sum(1), torch.zeros(4), atol=1e-5)
    prompts = exp.batch.input_ids[:, : exp.batch.prompt_width].reshape(4, 4, -1)
    assert all(torch.equal(g[0], g[i]) for g in prompts for i in range(4))  # a group is one prompt


def test_grpo_stage_checkpoints_no_critic_and_resumes(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = _config(small_assets, tmp_path, "grpo", n=2, steps=3)
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, "rl", sink=sink, every=1)
    stage_inputs = rl_inputs(cfg, sft_dir, rm_dir, norm)
    outcome = run(ctx, stage_inputs)
    assert outcome.step == 3
    names = list(ctx.store.manifest(3)["files"])
    assert any(n.startswith("optim/model.") for n in names) and not any("critic" in n for n in names), names
    assert [s for s, _ in sink.series("actor/kl_loss")] == [1, 2, 3]
    # Stopped after step 2 and started again with 3 steps: the uninterrupted stage's final state.
    ctx2 = make_ctx(tmp_path / "again", "rl", every=1)
    short = _config(small_assets, tmp_path, "grpo", n=2, steps=2)
    run(ctx2, rl_inputs(short, sft_dir, rm_dir, norm))
    (tmp_path / "again" / "rl" / "final.json").unlink()  # as if killed before the stage ended
    resumed = run(ctx2, stage_inputs)
    assert resumed.resumed_from == 2
    shards = lambda c: {n: e["sha256"] for n, e in c.store.manifest(3)["files"].items() if n.startswith("optim/")}
    assert shards(ctx2) == shards(ctx)


def _with_sources(small_assets, tmp_path, sources, **reward):
    cfg = _config(small_assets, tmp_path, "grpo", n=2, rollout_batch=4, mini_batch=4)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"generate_batch": 4})})
    tree = cfg.model_dump(mode="json") | {"reward": {"sources": sources, "workers": 2} | reward}
    return build_config(tree, "t")


def _step_with_pool(trained, cfg):
    """Step 1, its rule and function sources scored in their worker pool."""
    return _step(trained, cfg, Runtime())[1]


def test_weighted_sources_are_summed_and_each_is_logged(trained, small_assets, tmp_path):
    sources = [
        {"name": "rm", "type": "model", "weight": 1.0},
        {"name": "nice", "type": "keyword", "weight": 0.5, "kwargs": {"keywords": ["the", "."], "mode": "fraction"}},
        {
            "name": "chars",
            "type": "function",
            "weight": 2.0,
            "fn": "helpers.reward_fns:scaled_length",
            "kwargs": {"scale": 0.01},
        },
    ]
    metrics = _step_with_pool(trained, _with_sources(small_assets, tmp_path, sources))
    means = {n: metrics[f"reward/{n}/mean"] for n in ("rm", "nice", "chars")}
    assert means["chars"] > 0 and 0 < means["nice"] <= 1  # the rule and the function really scored
    expected = means["rm"] + 0.5 * means["nice"] + 2.0 * means["chars"]
    assert metrics["critic/score/mean"] == pytest.approx(expected, abs=1e-5)
    assert metrics["reward/chars/skipped"] == 0.0


def test_a_failing_reward_function_names_itself_or_is_skipped_and_counted(trained, small_assets, tmp_path):
    sources = [{"name": "boom", "type": "function", "fn": "helpers.reward_fns:scripted", "kwargs": {"behave": "raise"}}]
    with pytest.raises(RewardFunctionError, match=r"boom.*reward_fns:scripted.*ValueError.*reward.on_error=skip"):
        _step_with_pool(trained, _with_sources(small_assets, tmp_path, sources))
    metrics = _step_with_pool(trained, _with_sources(small_assets, tmp_path, sources, on_error="skip"))
    assert metrics["reward/boom/skipped"] == 8.0 and metrics["reward/boom/mean"] == 0.0


def _with_algorithm(cfg, **algorithm):
    tree = cfg.model_dump(mode="json")
    tree["algorithm"] |= algorithm
    return build_config(tree, "t")


def test_dynamic_sampling_tries_again_for_equal_groups_and_fills_the_batch(trained, small_assets, tmp_path):
    # A keyword no answer holds: every group scores 0, 0, so each try drops all 4 groups.
    never = [{"name": "never", "type": "keyword", "kwargs": {"keywords": ["zqxj"]}}]
    plain = _with_sources(small_assets, tmp_path, never)
    dynamic = _with_algorithm(plain, dynamic_sampling=True, dynamic_sampling_max_tries=2)
    m0, m1 = _step_with_pool(trained, plain), _step_with_pool(trained, dynamic)
    assert "rollout/filtered_groups" not in m0
    assert (m1["rollout/filtered_groups"], m1["rollout/sampling_tries"], m1["rollout/underfilled_groups"]) == (
        8.0,
        2.0,
        4.0,
    )
    # filled with the first try's groups, in order: the plain step's batch, and its update
    assert m1["rollout/response_ids_crc32"] == m0["rollout/response_ids_crc32"]
    assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], abs=1e-6)


def test_dynamic_sampling_keeps_a_batch_of_informative_groups_as_it_is(trained, small_assets, tmp_path):
    cfg = _config(small_assets, tmp_path, "grpo", rollout_batch=4, mini_batch=4)
    _, m0, _ = _step(trained, cfg, Runtime())
    _, m1, _ = _step(trained, _with_algorithm(cfg, dynamic_sampling=True), Runtime())
    assert (m1["rollout/filtered_groups"], m1["rollout/sampling_tries"]) == (0.0, 1.0)  # reward-model scores
    for key in ("rollout/response_ids_crc32", "actor/pg_loss", "actor/grad_norm"):
        assert m1[key] == m0[key], key


def test_the_overlong_penalty_enters_the_score(trained, small_assets, tmp_path):
    cfg = _config(small_assets, tmp_path, "grpo", rollout_batch=4, mini_batch=4)
    tree = cfg.model_dump(mode="json")
    tree["reward"] |= {"overlong_buffer": 12}  # the whole budget: the penalty is length / 12
    _, metrics, _ = _step(trained, build_config(tree, "t"), Runtime())
    expected = -metrics["response_length/mean"] / 12
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(expected, abs=1e-6)
    assert metrics["reward/overlong_penalty/fraction"] == 1.0  # every answer has a token
    score = metrics["reward/rm/mean"] + metrics["reward/overlong_penalty/mean"]
    assert metrics["critic/score/mean"] == pytest.approx(score, abs=1e-5)


@pytest.mark.parametrize("whole", [[], ["embed_tokens"]], ids=["adapters", "adapters+embedding"])
def test_lora_actor_trains_adapters_and_its_reference_is_itself_with_adapters_off(
    trained, small_assets, tmp_path, whole
):
    from rlflow.engine.models.lora import AdaptersOffView, trainable_parameters
    from rlflow.engine.models.loading import load_policy

    cfg = _config(small_assets, tmp_path, "grpo", n=2, rollout_batch=4, mini_batch=4)
    lora = {"r": 4, "modules_to_save": whole}
    cfg = build_config(cfg.model_dump(mode="json") | {"model": {**cfg.model.model_dump(), "lora": lora}}, "t")
    models, metrics, prompts = _step(trained, cfg, Runtime())
    assert isinstance(models.scoring.reference, AdaptersOffView)
    embedding = models.actor.model.get_input_embeddings().weight.numel() if whole else 0  # tied head: counted once
    adapters = 2 * 4 * 4 * (128 + 128)  # layers x q,k,v,o x r x (in + out)
    assert trainable_parameters(models.actor.model)[0] == adapters + embedding
    assert metrics["actor/kl"] == 0.0  # step 1 samples from the reference itself
    ids = torch.tensor([list(prompts.token_ids[0])])
    sft = load_policy(trained[0])
    with torch.no_grad():
        base = sft(input_ids=ids).logits
        assert torch.equal(models.scoring.reference(input_ids=ids).logits, base)  # the base never trained
        assert not torch.allclose(models.actor.model(input_ids=ids).logits, base)  # the adapters did


def test_a_steps_timings_add_the_step_and_what_no_phase_timed():
    from types import SimpleNamespace

    from rlflow.engine.stages.rl.step import with_timings

    exp = SimpleNamespace(batch=SimpleNamespace(attention_mask=torch.ones(2, 5)))  # 10 tokens
    phases = {"timing_s/gen": 1.0, "timing_s/update_actor": 0.5, "timing_s/wait_rollout": 0.7, "rollout/x": 3.0}
    phases |= {"timing_s/update_actor/part": 0.4}  # inside update_actor's 0.5 s: not counted again
    out = with_timings({"actor/kl": 0.1}, phases, 2.0, exp)
    # other = step - the phases (the waits overlap them; a worker's figures are no seconds)
    assert out["timing_s/step"] == 2.0 and out["timing_s/other"] == pytest.approx(0.5)
    assert out["perf/throughput"] == 5.0 and out["actor/kl"] == 0.1 and out["timing_s/wait_rollout"] == 0.7
