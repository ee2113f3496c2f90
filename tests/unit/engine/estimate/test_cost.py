"""Cost estimates and plan recommendations (rlflow.engine.estimate.cost): GPU hours times price, a
published DeepSpeed-Chat run, DPO's phases, and which ZeRO plan is picked or why none fits.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from helpers.workloads import workload
from rlflow.engine.estimate.cost import estimate_rl, recommend
from rlflow.engine.estimate.hardware import device_spec, load_price_book
from rlflow.engine.estimate.memory import (
    partitioned_states,
    training_activation_bytes,
)
from rlflow.engine.estimate.model_shape import (
    REFERENCE_SHAPES,
    shape_from_hf_config,
)
from rlflow.engine.estimate.timing import (
    EFFICIENCY,
)
from rlflow.engine.estimate.workload import PRECISIONS, BackendPrecisions, DPOWorkload, Strategy, Workload

ROOT = Path(__file__).parents[4]
PRICES = load_price_book(ROOT / "configs" / "prices.yaml")
A100 = device_spec(PRICES, "a100-80g")
BF16 = PRECISIONS["bf16-mixed"]
LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]


def test_cost_is_hours_times_gpus_times_price():
    estimate = estimate_rl(workload(LLAMA_8B), Strategy(3, 8), A100, "USD")
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
    hours = estimate_rl(w, Strategy(3, 8, gradient_checkpointing=True), A100, "USD").total_hours
    assert 9 / 2 < hours < 9 * 2


def dpo_workload(**changes) -> DPOWorkload:
    base = DPOWorkload(
        LLAMA_8B, LLAMA_8B, pairs=1000, batch_size=32, epochs=2, seq_tokens=512, precision=BF16, micro_batch_size=4
    )
    return replace(base, **changes)


def test_dpo_holds_one_model_per_phase_and_runs_the_reference_pass_once():
    w, s = dpo_workload(), Strategy(3, 8, gradient_checkpointing=True)
    e = estimate_rl(w, s, A100, "USD")
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
    e = estimate_rl(w, s, A100, "USD")
    gpu = EFFICIENCY["gpu"]
    ratio = (1 / gpu.forward_mfu) / (3 / gpu.train_mfu)
    assert e.setup_s / (e.step.training * e.steps) == pytest.approx(ratio, rel=0.03)


def test_dpo_of_an_8b_policy_gets_a_zero_plan_and_too_many_ranks_are_refused():
    advice = recommend(dpo_workload(), A100, "USD", 8, Strategy(0, 1))
    assert advice.best.fits and advice.best.strategy.zero_stage >= 1 and "the 8.03B policy" in advice.reason
    assert dpo_workload(batch_size=4).rank_shares_problem(8) == "dpo.batch_size=4 is below 8 ranks"


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
