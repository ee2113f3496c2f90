"""The cost estimator with model.lora: trainable counts against peft on a real model, what the
memory and time formulas change (and only that), and the plan search on one device."""

from dataclasses import replace
from pathlib import Path

import pytest

from helpers.workloads import workload
from rlflow.engine.config.model import LoraConfig
from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.cost import candidate_plans, estimate_rl, recommend
from rlflow.engine.estimate.hardware import device_spec, load_price_book
from rlflow.engine.estimate.memory import GPU_FRAGMENTATION, estimate_dpo_memory, estimate_memory
from rlflow.engine.estimate.model_shape import REFERENCE_SHAPES, LoraShape, load_model_shape
from rlflow.engine.estimate.timing import training_seconds, update_seconds, weight_grad_share
from rlflow.engine.estimate.workload import PRECISIONS, DPOWorkload, Strategy, Workload

ROOT = Path(__file__).parents[4]
H100 = device_spec(load_price_book(ROOT / "configs" / "prices.yaml"), "h100-80g")
BF16 = PRECISIONS["bf16"]  # the torch backend in bfloat16: what LoRA trains in on a GPU
LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]
TORCH = Strategy(0, 1)
QKVO = LoraShape(16, ("q_proj", "k_proj", "v_proj", "o_proj"))


def rl(lora: LoraShape | None = None, shared: bool = False, **changes) -> Workload:
    """test_estimate's 8B workload in the torch backend's bf16, with `lora`."""
    return workload(LLAMA_8B, precision=BF16, lora=lora, reference_shared=shared, **changes)


@pytest.mark.parametrize(
    "targets, whole",
    [
        (["q_proj", "k_proj", "v_proj", "o_proj"], []),
        ("all-linear", []),
        ("all-linear", ["embed_tokens"]),  # tied in the demo model: one trained tensor
        (["q_proj", "v_proj"], ["embed_tokens", "gate_proj"]),
    ],
)
def test_trainable_counts_equal_peft_on_the_demo_model(small_assets, targets, whole):
    from rlflow.engine.models.lora import apply_lora, trainable_parameters
    from rlflow.engine.models.loading import load_policy, load_scalar_model

    path = str(small_assets / "tiny-model")
    shape = load_model_shape(path)
    estimate = LoraShape(8, ("all-linear",) if targets == "all-linear" else tuple(targets), tuple(whole))
    cfg = LoraConfig(r=8, target_modules=targets, modules_to_save=whole)
    assert estimate.trainable(shape, scalar=False) == trainable_parameters(apply_lora(load_policy(path), cfg))[0]
    assert estimate.trainable(shape, scalar=True) == trainable_parameters(apply_lora(load_scalar_model(path), cfg))[0]


def test_adapter_count_by_hand_and_unknown_layers_named():
    # Llama-3.1-8B: 32 layers x 16 x (q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096) = 13,631,488
    assert QKVO.adapter_params(LLAMA_8B) == 32 * 16 * (8192 + 5120 + 5120 + 8192) == 13_631_488
    # all-linear adds gate/up (4096 -> 14336) and down (14336 -> 4096): 41,943,040; the untied embedding
    # trains whole as one 128256 x 4096 copy (its separate LM head stays frozen)
    everything = LoraShape(16, ("all-linear",), ("embed_tokens",))
    assert everything.trainable(LLAMA_8B, scalar=False) == 32 * 16 * (26624 + 3 * 18432) + 128256 * 4096
    with pytest.raises(ConfigError, match="the estimate knows the linear layers q_proj.*; qkv is none of them"):
        LoraShape(8, ("qkv",)).adapter_params(LLAMA_8B)


def test_lora_memory_keeps_the_base_and_moves_only_the_trained_states():
    full, lora = estimate_memory(rl(), TORCH, H100), estimate_memory(rl(QKVO), TORCH, H100)
    actor, critic = QKVO.trainable(LLAMA_8B, False), QKVO.trainable(LLAMA_8B, True)
    for a, b in zip(full.phases, lora.phases):
        fa, fb = a.components(), b.components()
        assert fb["actor_weights"] - fa["actor_weights"] == pytest.approx(actor * BF16.weight_bytes)  # + adapters
        assert fb["critic_weights"] - fa["critic_weights"] == pytest.approx(critic * BF16.weight_bytes)
        assert fb["optimizer_states"] == pytest.approx((actor + critic) * BF16.optimizer_bytes)
        assert fb["activations"] == fa["activations"] and fb["reference_weights"] == fa["reference_weights"]
    assert lora.phases[-1].components()["gradients"] == pytest.approx(critic * BF16.grad_bytes)  # the larger one
    assert full.peak.total / lora.peak.total > 1.5  # 8B with a critic: Adam states dominate full training


def test_a_shared_reference_drops_exactly_one_copy_of_the_weights():
    copy, shared = estimate_memory(rl(QKVO), TORCH, H100), estimate_memory(rl(QKVO, shared=True), TORCH, H100)
    for a, b in zip(copy.phases, shared.phases):
        ref = LLAMA_8B.lm_params * BF16.weight_bytes
        assert a.components()["reference_weights"] == pytest.approx(ref) and b.components()["reference_weights"] == 0
        assert a.total - b.total == pytest.approx(ref * (1 + GPU_FRAGMENTATION))
    with pytest.raises(ConfigError, match="reference_shared needs lora"):
        rl(None, shared=True)


def test_lora_backward_skips_the_frozen_weight_gradients():
    """Training compute is passes x one forward: 3 in full (forward, input and weight gradients),
    2 with LoRA plus the share of matmul weights that train whole; the optimizer step shrinks with
    the trained parameters."""

    def compute(share: float) -> float:  # no micro-batches: no per-call overheads, compute alone
        return update_seconds(LLAMA_8B, 1e15, 10**6, BF16, TORCH, H100, steps=1, micro=0, weight_grads=share)[0]

    assert compute(0.0) / compute(1.0) == pytest.approx(2 / 3, rel=1e-12)
    assert weight_grad_share(None, LLAMA_8B, False, LLAMA_8B.lm_flop_params) == 1.0
    assert weight_grad_share(QKVO, LLAMA_8B, False, LLAMA_8B.lm_flop_params) == 0.0
    head = LoraShape(16, ("q_proj",), ("lm_head",))  # Llama-3.1-8B's untied LM head trains whole
    share = LLAMA_8B.vocab_size * LLAMA_8B.hidden_size / LLAMA_8B.lm_flop_params  # ~0.07
    assert weight_grad_share(head, LLAMA_8B, False, LLAMA_8B.lm_flop_params) == pytest.approx(share)
    assert weight_grad_share(head, LLAMA_8B, True, LLAMA_8B.scalar_flop_params) == 0.0  # a critic has no LM head
    (fwd_full, adam_full, _), (fwd_lora, adam_lora, _) = (training_seconds(w, TORCH, H100) for w in (rl(), rl(QKVO)))
    assert fwd_lora < fwd_full and adam_lora / adam_full == pytest.approx(
        rl(QKVO).trainable_params / rl().trainable_params, rel=1e-9
    )


def test_lora_plans_stay_on_one_device_and_the_advice_says_why():
    assert len(candidate_plans(rl(QKVO), H100, 8, TORCH)) == 1
    fits = recommend(
        rl(QKVO, shared=True, prompt_tokens=256, response_tokens=256, micro_batch_size=2), H100, "USD", 8, TORCH
    )
    assert fits.best is not None and fits.best.strategy == TORCH and "LoRA: 27.27M trainable" in fits.reason
    huge = REFERENCE_SHAPES["Llama-3.1-70B"]
    big = rl(QKVO, shared=True, actor=huge, critic=huge, reference=huge, reward=huge)
    advice = recommend(big, H100, "USD", 8, TORCH)
    assert advice.best is None and "model.lora trains on one device" in advice.reason


def test_dpo_with_lora_trains_the_adapters_and_holds_the_base():
    dpo = DPOWorkload(LLAMA_8B, LLAMA_8B, pairs=4096, batch_size=32, epochs=1, seq_tokens=512, precision=BF16)
    full = estimate_dpo_memory(dpo, TORCH, H100).phases[-1].components()
    lora = estimate_dpo_memory(replace(dpo, lora=QKVO), TORCH, H100).phases[-1].components()
    adapters = QKVO.trainable(LLAMA_8B, False)
    assert lora["actor_weights"] == pytest.approx((LLAMA_8B.lm_params + adapters) * BF16.weight_bytes)
    assert lora["optimizer_states"] == pytest.approx(adapters * BF16.optimizer_bytes)
    assert full["optimizer_states"] / lora["optimizer_states"] > 500
    assert estimate_rl(replace(dpo, lora=QKVO), TORCH, H100, "USD").step.training < (
        estimate_rl(dpo, TORCH, H100, "USD").step.training
    )
