"""Step times (rlflow.engine.estimate.timing): FLOPs per token, bandwidth-bound decoding and the
compute cost of gradient checkpointing, on reference shapes and configs/prices.yaml devices.
"""

from dataclasses import asdict, replace
from pathlib import Path

import pytest

from helpers.workloads import workload
from rlflow.engine.estimate.hardware import device_spec, load_price_book
from rlflow.engine.estimate.memory import (
    estimate_memory,
)
from rlflow.engine.estimate.model_shape import (
    REFERENCE_SHAPES,
)
from rlflow.engine.estimate.timing import (
    DECODE_ENGINES,
    estimate_step_time,
    forward_flops,
    generation_seconds,
    training_seconds,
)
from rlflow.engine.estimate.workload import Strategy

ROOT = Path(__file__).parents[4]
PRICES = load_price_book(ROOT / "configs" / "prices.yaml")
A100 = device_spec(PRICES, "a100-80g")
PHASES = ("generation", "scoring", "training", "optimizer", "communication")
LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]


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


def test_sampling_beside_training_costs_the_slower_side_only_with_a_server_of_its_own():
    shape = LLAMA_8B
    sync = workload(shape, rollout_engine="vllm", rollout_gpus=1)
    overlapped = replace(sync, overlap=True)
    memory = estimate_memory(sync, Strategy(3, 7), A100)
    a = estimate_step_time(sync, Strategy(3, 7), A100, memory)
    b = estimate_step_time(overlapped, Strategy(3, 7), A100, memory)
    assert not a.overlapped and a.total == a.sequential == pytest.approx(sum(asdict(a)[k] for k in PHASES))
    assert b.overlapped and b.sequential == a.sequential
    assert b.total == pytest.approx(max(b.generation, b.scoring + b.training + b.optimizer + b.communication))
    assert b.total < a.total
    # on the training GPUs (no GPUs of its own) the sampler cannot run beside training
    shared = replace(overlapped, rollout_gpus=0)
    memory = estimate_memory(shared, Strategy(3, 7), A100)
    assert not estimate_step_time(shared, Strategy(3, 7), A100, memory).overlapped
