"""The cost estimator's formulas against hand computations, published figures and real models.

No model is trained and no GPU is needed: shapes are a few integers, devices come from
configs/prices.yaml, and the CPU calibration is replaced by fixed numbers.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate import estimate_ppo, recommend
from rlflow.engine.estimate_hardware import CpuCalibration, device_spec, load_price_book, measure_cpu
from rlflow.engine.estimate_memory import (
    GIB,
    GPU_FRAGMENTATION,
    activation_bytes_per_token_layer,
    estimate_memory,
    kv_cache_bytes,
    partitioned_states,
    training_activation_bytes,
)
from rlflow.engine.estimate_model import (
    REFERENCE_SHAPES,
    ModelShape,
    load_model_shape,
    parse_size,
    resolve_model,
    shape_from_hf_config,
    shape_from_size,
)
from rlflow.engine.estimate_time import (
    DECODE_ENGINES,
    EFFICIENCY,
    forward_flops,
    generation_seconds,
    scoring_seconds,
    training_seconds,
)
from rlflow.engine.estimate_workload import PRECISIONS, BackendPrecisions, DPOWorkload, Strategy, Workload

ROOT = Path(__file__).parents[2]
PRICES = load_price_book(ROOT / "configs" / "prices.yaml")
A100 = device_spec(PRICES, "a100-80g")
FIXED_CPU = CpuCalibration(fp32_tflops=0.138, memory_gbs=11.2, ram_gib=23.6)
BF16 = PRECISIONS["bf16-mixed"]
LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]
QWEN_05B = REFERENCE_SHAPES["Qwen2.5-0.5B"]


def workload(shape: ModelShape, **changes) -> Workload:
    base = Workload(
        actor=shape,
        critic=shape,
        reference=shape,
        reward=shape,
        rollout_batch=64,
        prompt_tokens=512,
        response_tokens=512,
        mini_batch=32,
        epochs=1,
        steps=100,
        generate_batch=16,
        precision=BF16,
        micro_batch_size=4,
    )
    return replace(base, **changes)


# --- model shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_match_real_llama_models(tied):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: K/V narrower than Q
        head_dim=16,
        vocab_size=101,
        tie_word_embeddings=tied,
        num_labels=1,
    )
    shape = shape_from_hf_config(config.to_dict(), "test")
    assert shape.lm_params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert shape.scalar_params == sum(p.numel() for p in LlamaForSequenceClassification(config).parameters())
    # FLOPs count every matmul weight: the LM head even when tied, never the embedding lookup.
    assert shape.lm_flop_params == shape.num_layers * shape.layer_params + 101 * 64


def test_parameter_count_of_qwen2_includes_its_qkv_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, tie_word_embeddings=True,
    )  # fmt: skip
    shape = shape_from_hf_config(config.to_dict(), "test")
    assert shape.bias_qkv and shape.lm_params == sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())


def test_reference_shapes_give_the_published_parameter_counts():
    assert REFERENCE_SHAPES["Llama-2-7B"].lm_params == 6_738_415_616
    assert LLAMA_8B.lm_params == 8_030_261_248
    assert REFERENCE_SHAPES["Llama-3.1-70B"].lm_params == 70_553_706_496
    assert REFERENCE_SHAPES["Qwen2.5-0.5B"].lm_params == 494_032_768


def test_sizes_parse_and_pick_the_nearest_reference_or_scale_its_depth():
    assert parse_size("7B") == 7e9 and parse_size("0.5b") == 5e8 and parse_size("350M") == 3.5e8
    assert parse_size("demo_assets/tiny-model") is None and parse_size("12") is None
    assert shape_from_size(7e9) == replace(REFERENCE_SHAPES["Llama-2-7B"], source=shape_from_size(7e9).source)
    twenty = shape_from_size(20e9)  # between 13B and 32B: Llama-2-13B widths, more layers
    assert abs(twenty.lm_params - 20e9) < twenty.layer_params and twenty.hidden_size == 5120


def test_model_folders_are_read_and_bad_ones_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "intermediate_size": 256, "vocab_size": 351, "tie_word_embeddings": true}'
    )
    assert load_model_shape(tmp_path / "m").num_kv_heads == 4  # defaults to the attention heads
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="neither a local model folder nor a size like 7B"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "m" / "config.json").write_text('{"hidden_size": 128}')
    with pytest.raises(ConfigError, match="no positive integer 'num_attention_heads'"):
        load_model_shape(tmp_path / "m")


# --- memory -------------------------------------------------------------------------------------


def test_zero_partitioning_reproduces_the_zero_paper_figure():
    # Rajbhandari et al. 2019, Figure 1: 7.5B parameters, Adam, mixed precision, 64 GPUs.
    psi = 7.5e9
    assert sum(partitioned_states(psi, BF16, 0, 64)) == 120e9  # 16 bytes per parameter
    assert round(sum(partitioned_states(psi, BF16, 1, 64)) / 1e9, 1) == 31.4
    assert round(sum(partitioned_states(psi, BF16, 2, 64)) / 1e9, 1) == 16.6
    assert round(sum(partitioned_states(psi, BF16, 3, 64)) / 1e9, 1) == 1.9


def test_doubling_the_gpus_under_zero3_halves_every_partitioned_state():
    w = workload(LLAMA_8B)
    eight, sixteen = (estimate_memory(w, Strategy(3, n), A100).peak for n in (8, 16))
    for name in ("actor_weights", "critic_weights", "reference_weights", "reward_weights"):
        assert getattr(sixteen, name) == pytest.approx(getattr(eight, name) / 2)
    assert sixteen.gradients == pytest.approx(eight.gradients / 2)
    assert sixteen.optimizer_states == pytest.approx(eight.optimizer_states / 2)


def test_zero2_keeps_whole_weights_and_offload_moves_states_to_the_host():
    w = workload(LLAMA_8B)
    plain = estimate_memory(w, Strategy(2, 8), A100)
    assert plain.peak.actor_weights == LLAMA_8B.lm_params * 2
    offloaded = estimate_memory(w, Strategy(2, 8, offload="optimizer"), A100)
    assert offloaded.peak.optimizer_states == 0 and offloaded.peak.gradients == 0
    states = (LLAMA_8B.lm_params + LLAMA_8B.scalar_params) * (12 + 4) / 8  # fp32 moments+master, fp32 grads
    assert offloaded.cpu_ram_per_node - plain.cpu_ram_per_node == pytest.approx(8 * states)


def test_activation_formula_is_korthikanti_without_dropout_and_checkpointing_shrinks_it():
    gpt = ModelShape(1024, 24, 16, 16, 64, 4096, 50000, True, gated_mlp=False, layer_norm=True)
    # Korthikanti et al. 2022: 34 s b h bytes per layer at 2-byte activations, of which 2 sbh are
    # dropout masks; SDPA keeps no s x s scores.
    assert activation_bytes_per_token_layer(gpt, 2) == 32 * 1024
    full = training_activation_bytes(LLAMA_8B, 4096, 2, checkpointing=False)
    checkpointed = training_activation_bytes(LLAMA_8B, 4096, 2, checkpointing=True)
    assert checkpointed == 32 * 2 * 4096 * 4096 + full / 32  # layer inputs + one layer recomputed
    w = workload(LLAMA_8B)
    with_gc = estimate_memory(w, Strategy(3, 8, gradient_checkpointing=True), A100).phases[2]
    without = estimate_memory(w, Strategy(3, 8), A100).phases[2]
    assert with_gc.activations < without.activations / 5


def test_kv_cache_matches_a_hand_computation():
    # Llama-3.1-8B: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token.
    assert kv_cache_bytes(LLAMA_8B, rows=16, tokens=1024, e=2) == 2 * 32 * 8 * 128 * 2 * 16 * 1024
    rollout = estimate_memory(workload(LLAMA_8B), Strategy(3, 8), A100).phases[0]
    assert rollout.phase == "rollout" and rollout.kv_cache == 2 * GIB


def test_the_peak_is_the_largest_phase_not_the_sum():
    memory = estimate_memory(workload(LLAMA_8B), Strategy(3, 8), A100)
    assert memory.peak.total == max(p.total for p in memory.phases)
    assert memory.phases[0].gradients == 0 and memory.phases[2].kv_cache == 0


# --- time ---------------------------------------------------------------------------------------


def test_forward_flops_are_two_per_parameter_per_token_plus_attention():
    shape = LLAMA_8B
    expected = 2 * shape.lm_flop_params * 4 * 100 + 2 * 32 * 4096 * 100**2 * 4
    assert forward_flops(shape.lm_flop_params, shape, 4, 100) == expected


def test_decode_time_scales_with_memory_bandwidth():
    # A decode step of a 70B model is bandwidth-bound: doubling the bandwidth halves what is not overhead.
    shape = REFERENCE_SHAPES["Llama-3.1-70B"]
    w = workload(shape, generate_batch=8, rollout_batch=8, mini_batch=8, prompt_tokens=64, response_tokens=128)
    fast = replace(A100, memory_gbs=2 * A100.memory_gbs, bf16_tflops=1e6)
    slow = replace(A100, bf16_tflops=1e6)
    memory = estimate_memory(w, Strategy(3, 1), A100)
    engine = DECODE_ENGINES["hf"]
    overhead = w.response_tokens * (engine.step_overhead_s + engine.layer_overhead_s * shape.num_layers)
    t_slow = generation_seconds(w, Strategy(3, 1), slow, memory)[0] - overhead
    t_fast = generation_seconds(w, Strategy(3, 1), fast, memory)[0] - overhead
    assert t_slow == pytest.approx(2 * t_fast)


def test_gradient_checkpointing_costs_a_third_more_training_compute():
    w = workload(REFERENCE_SHAPES["Llama-3.1-70B"], micro_batch_size=16)
    plain = training_seconds(w, Strategy(3, 8), A100)[0]
    checkpointed = training_seconds(w, Strategy(3, 8, gradient_checkpointing=True), A100)[0]
    assert checkpointed / plain == pytest.approx(4 / 3, rel=0.01)


def test_cost_is_hours_times_gpus_times_price():
    estimate = estimate_ppo(workload(LLAMA_8B), Strategy(3, 8), A100, "USD")
    assert estimate.gpu_hours == pytest.approx(estimate.step.total * 100 / 3600 * 8)
    assert estimate.cost == pytest.approx(estimate.gpu_hours * A100.price_per_gpu_hour)


def test_deepspeed_chat_opt13b_on_8_a100s_is_within_a_factor_of_two_of_the_published_9_hours():
    # DeepSpeedExamples applications/DeepSpeed-Chat README, Table 1: OPT-13B actor, OPT-350M
    # critic/reward, 131.9k queries of 256 + 256 tokens, 8x A100-80G: 9 hours for step 3.
    def opt(hidden, layers, heads, ffn):
        return shape_from_hf_config(
            {"model_type": "opt", "hidden_size": hidden, "num_hidden_layers": layers,
             "num_attention_heads": heads, "ffn_dim": ffn, "vocab_size": 50272}, "opt",
        )  # fmt: skip

    actor, small = opt(5120, 40, 40, 20480), opt(1024, 24, 16, 4096)
    w = Workload(
        actor, small, actor, small, rollout_batch=128, prompt_tokens=256, response_tokens=256, mini_batch=128,
        epochs=1, steps=-(-131_900 // 128), generate_batch=16, precision=BF16, micro_batch_size=16,
    )  # fmt: skip
    hours = estimate_ppo(w, Strategy(3, 8, gradient_checkpointing=True), A100, "USD").total_hours
    assert 9 / 2 < hours < 9 * 2


# --- algorithms ---------------------------------------------------------------------------------


def grpo_of(ppo: Workload, n: int = 4) -> Workload:
    """The GRPO workload with the same rows as `ppo`: 1/n of its prompts x n samples, no critic."""
    prompts, mini = ppo.rollout_batch // n, ppo.mini_batch // n
    return replace(
        ppo,
        algorithm="grpo",
        critic=None,
        samples_per_prompt=n,
        kl_in_loss=True,
        rollout_batch=prompts,
        mini_batch=mini,
    )


def test_grpo_16_prompts_x_4_samples_samples_and_scores_what_ppo_with_64_prompts_does():
    ppo = workload(LLAMA_8B)  # 64 prompts, mini-batch 32
    grpo = grpo_of(ppo)
    assert (grpo.rollout_batch, grpo.samples_per_prompt) == (16, 4)
    assert grpo.rows == ppo.rows == 64 and grpo.mini_rows == ppo.mini_rows == 32 and grpo.chunks == ppo.chunks == 4
    s = Strategy(3, 8)
    assert generation_seconds(grpo, s, A100, estimate_memory(grpo, s, A100)) == generation_seconds(
        ppo, s, A100, estimate_memory(ppo, s, A100)
    )
    # The same rows through the reference and the reward model; PPO adds the critic's values pass
    # and the critic's update, GRPO nothing (its KL is a loss term on the reference log-probs).
    assert scoring_seconds(grpo, s, A100) == scoring_seconds(replace(ppo, critic=None), s, A100)
    assert scoring_seconds(grpo, s, A100)[0] < scoring_seconds(ppo, s, A100)[0]
    assert training_seconds(grpo, s, A100) == training_seconds(replace(ppo, critic=None), s, A100)
    # A vLLM server holds the KV cache of all rows of the step, prompts x samples.
    vllm = {"rollout_engine": "vllm", "rollout_gpus": 1}
    concurrency = [estimate_memory(replace(w, **vllm), s, A100).rollout_concurrency for w in (ppo, grpo)]
    assert concurrency == [64, 64]
    assert "GRPO: 16 prompts x 4 samples = 64 rows per step, no critic, KL in the loss" in grpo.label


@pytest.mark.parametrize("strategy", [Strategy(0, 1), Strategy(1, 8), Strategy(3, 8)], ids=lambda s: s.label)
def test_critic_free_memory_is_smaller_by_exactly_the_critics_states(strategy):
    ppo = workload(LLAMA_8B, critic=QWEN_05B)
    grpo = grpo_of(ppo)
    weights, grads, optimizer = partitioned_states(QWEN_05B.scalar_params, BF16, strategy.zero_stage, strategy.n_gpus)
    for with_critic, without in zip(
        estimate_memory(ppo, strategy, A100).phases, estimate_memory(grpo, strategy, A100).phases
    ):
        critic = {"critic_weights": weights, "optimizer_states": optimizer}
        if (
            with_critic.phase == "training" and strategy.zero_stage > 0
        ):  # the torch backend frees each model's at its step
            critic["gradients"] = grads
        less = {k: v - without.components()[k] for k, v in with_critic.components().items()}
        assert less.pop("framework_overhead") == pytest.approx(GPU_FRAGMENTATION * sum(critic.values()))
        assert less == pytest.approx(dict.fromkeys(less, 0.0) | critic), with_critic.phase


def test_rule_rewards_need_no_reward_model_and_a_reward_model_by_path_costs_like_the_rounds():
    ppo, s = workload(LLAMA_8B), Strategy(3, 8)
    rules = replace(ppo, reward=None)  # reward.sources: rules and functions only, in CPU workers
    assert all(p.reward_weights == 0 for p in estimate_memory(rules, s, A100).phases)
    assert scoring_seconds(rules, s, A100)[0] < scoring_seconds(ppo, s, A100)[0]
    by_path = replace(ppo, reward=None, extra_rewards=(LLAMA_8B,))
    assert estimate_memory(by_path, s, A100) == estimate_memory(ppo, s, A100)
    assert scoring_seconds(by_path, s, A100) == scoring_seconds(ppo, s, A100)


def dpo_workload(**changes) -> DPOWorkload:
    base = DPOWorkload(
        LLAMA_8B, LLAMA_8B, pairs=1000, batch_size=32, epochs=2, seq_tokens=512, precision=BF16, micro_batch_size=4
    )
    return replace(base, **changes)


def test_dpo_holds_one_model_per_phase_and_runs_the_reference_pass_once():
    w, s = dpo_workload(), Strategy(3, 8, gradient_checkpointing=True)
    e = estimate_ppo(w, s, A100, "USD")
    reference, training = e.memory.phases
    assert (reference.phase, training.phase) == ("reference", "training")
    # The reference pass runs before the policy is loaded; the reference is freed before training.
    assert reference.actor_weights == reference.gradients == reference.optimizer_states == 0
    assert reference.reference_weights == LLAMA_8B.lm_params * 2 / 8
    states = partitioned_states(LLAMA_8B.lm_params, BF16, 3, 8)
    assert (training.actor_weights, training.gradients, training.optimizer_states) == states
    assert training.reference_weights == training.critic_weights == training.reward_weights == training.kv_cache == 0
    # 32 pairs over 8 ranks: 4 pairs per micro-batch, chosen + rejected = 8 sequences of 512 tokens.
    assert training.activations == training_activation_bytes(LLAMA_8B, 8 * 512, 2, checkpointing=True)
    assert e.steps == 2 * 32 and e.step.generation == e.step.scoring == 0 and e.setup_s > 0
    assert e.total_hours == pytest.approx((e.step.total * e.steps + e.setup_s) / 3600)


def test_dpo_reference_pass_is_a_forward_over_what_one_epoch_trains_on():
    # Compute-bound and without ZeRO-3 gathers: the pass over 1000 pairs costs a forward where an
    # epoch over the same pairs costs forward + backward (3 forwards), at their MFUs.
    w, s = dpo_workload(epochs=1), Strategy(1, 8)
    e = estimate_ppo(w, s, A100, "USD")
    gpu = EFFICIENCY["gpu"]
    ratio = (1 / gpu.forward_mfu) / (3 / gpu.train_mfu)
    assert e.setup_s / (e.step.training * e.steps) == pytest.approx(ratio, rel=0.03)


def test_dpo_of_an_8b_policy_gets_a_zero_plan_and_too_many_ranks_are_refused():
    advice = recommend(dpo_workload(), A100, "USD", 8, Strategy(0, 1))
    assert advice.best.fits and advice.best.strategy.zero_stage >= 1 and "the 8.03B policy" in advice.reason
    assert dpo_workload(batch_size=4).rank_shares_problem(8) == "dpo.batch_size=4 is below 8 ranks"


# --- recommendation -----------------------------------------------------------------------------


def test_a_70b_run_needs_zero3_over_more_than_one_a100_node():
    w = workload(REFERENCE_SHAPES["Llama-3.1-70B"], rollout_batch=256, mini_batch=64)
    base = Strategy(0, 1, gradient_checkpointing=True)
    one_node = recommend(w, A100, "USD", 8, base)
    assert one_node.best is None
    assert "nothing fits on a100-80g with up to 8 GPUs" in one_node.reason and "host RAM" in one_node.reason
    cluster = recommend(w, A100, "USD", 64, base)
    assert cluster.best.strategy.zero_stage == 3 and cluster.best.strategy.n_gpus >= 16 and cluster.best.fits
    assert (
        cluster.reason.startswith(f"ZeRO-3 over {cluster.best.strategy.n_gpus} GPUs")
        and "does not fit" in cluster.reason
    )


def test_a_7b_run_on_one_node_gets_a_zero_plan_that_fits():
    w = workload(REFERENCE_SHAPES["Llama-2-7B"])
    precisions = BackendPrecisions.of("auto", "float32", on_gpu=True)
    advice = recommend(replace(w, precision=precisions.torch), A100, "USD", 8, Strategy(0, 1), precisions)
    assert advice.best.fits and advice.best.strategy.zero_stage >= 1 and advice.best.workload.precision == BF16


def test_a_batch_too_big_for_any_plan_says_to_shrink_the_batch():
    w = workload(LLAMA_8B, micro_batch_size=None, mini_batch=64, prompt_tokens=4096, response_tokens=4096)
    advice = recommend(w, A100, "USD", 1, Strategy(0, 1))
    assert advice.best is None and "engine.micro_batch_size=1" in advice.reason


# --- devices and strategies ---------------------------------------------------------------------


def test_the_cpu_device_is_measured_and_unknown_devices_list_the_valid_ones():
    cpu = device_spec(PRICES, "cpu", FIXED_CPU)
    assert cpu.measured and cpu.fp32_tflops == 0.138 and cpu.memory_gib == 23.6
    with pytest.raises(ConfigError, match=r"unknown GPU type 'a100' \(--gpu\); valid types in .*a100-80g"):
        device_spec(PRICES, "a100")
    with pytest.raises(ConfigError, match="CPU calibration"):
        device_spec(PRICES, "cpu")
    quick = measure_cpu(matmul_size=128, copy_mib=4, repeats=1)
    assert quick.fp32_tflops > 0 and quick.memory_gbs > 0 and quick.ram_gib > 0


def test_a_bad_price_entry_is_named(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("currency: EUR\ndevices:\n  x:\n    memory_gib: -1\n")
    with pytest.raises(ConfigError, match=r"devices.x.memory_gib must be a positive number, got -1"):
        load_price_book(path)
    path.write_text("devices: {}\n")
    with pytest.raises(ConfigError, match="devices"):
        load_price_book(path)


def test_impossible_strategies_are_refused():
    with pytest.raises(ConfigError, match="--zero 0 is the torch backend"):
        Strategy(0, 2)
    with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
        Strategy(2, 8, offload="all")
    with pytest.raises(ConfigError, match="unknown offload 'cpu'.*valid: none, optimizer, all"):
        Strategy(3, 8, offload="cpu")
