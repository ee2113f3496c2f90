"""The memory estimate's formulas (rlflow.engine.estimate.memory) against hand computations and
published figures: ZeRO partitioning, activations, the KV cache and the peak phase.

No model is trained and no GPU is needed: shapes are a few integers and devices come from
configs/prices.yaml.
"""

from pathlib import Path

import pytest

from helpers.workloads import workload
from rlflow.engine.estimate.hardware import device_spec, load_price_book
from rlflow.engine.estimate.memory import (
    GIB,
    activation_bytes_per_token_layer,
    estimate_memory,
    kv_cache_bytes,
    partitioned_states,
    training_activation_bytes,
)
from rlflow.engine.estimate.model_shape import (
    REFERENCE_SHAPES,
    ModelShape,
)
from rlflow.engine.estimate.workload import PRECISIONS, Strategy

ROOT = Path(__file__).parents[4]
PRICES = load_price_book(ROOT / "configs" / "prices.yaml")
A100 = device_spec(PRICES, "a100-80g")
BF16 = PRECISIONS["bf16-mixed"]
LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]


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


# --- devices and strategies ---------------------------------------------------------------------
