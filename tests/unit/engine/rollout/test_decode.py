"""rlflow's decode loop (engine/rollout/decode.py) against transformers itself: greedy tokens equal HF
generate's, every sampled token's log-prob equals a full teacher-forced HF forward's, the draw
follows softmax exactly, top-p equals HF's warper, and weight changes are picked up."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from rlflow.engine.data.batching import left_pad
from rlflow.engine.rollout.decode import decode, filter_top_p, unsupported_reason
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import sample_tokens
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TopPLogitsWarper

VOCAB, PAD, STOP = 96, 0, 1
PROMPTS = [[5, 9, 12, 40, 7], [33, 2], [60, 61, 62], [17] * 7]  # ragged: left padding is exercised


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=STOP,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:  # q/k/v biases, untied head
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    for p in model.parameters():  # larger than init's 0.02 so logits are far from uniform
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    return model.eval()


def prompts():
    return left_pad(PROMPTS, PAD)


def hf_greedy(model, ids, attention, new):
    config = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=PAD, eos_token_id=[STOP])
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=attention, generation_config=config)[:, ids.shape[1] :]


def teacher_forced_logprobs(model, ids, attention, response, temperature):
    """Log-probs of `response` [B, R] by one full HF forward over prompt + response."""
    full = torch.cat([ids, response], 1)
    mask = torch.cat([attention, torch.ones_like(response)], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=mask, position_ids=positions).logits.float()
    logits = logits[:, ids.shape[1] - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, response[..., None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_tokens_equal_hf_generate(kind):
    model = tiny(kind)
    ids, attention = prompts()
    out = decode(model, ids, attention, 0.0, 1.0, 12, [STOP], PAD, seed=0)
    assert torch.equal(out.tokens, hf_greedy(model, ids, attention, 12))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sampled_logprobs_equal_a_full_forward(kind):
    """Every position's cache, rotary position and key mask is right iff each sampled token's
    log-prob equals the teacher-forced forward's; stops are off so all 16 positions count."""
    model = tiny(kind)
    ids, attention = prompts()
    out = decode(model, ids, attention, 0.8, 1.0, 16, [], PAD, seed=3)
    assert out.tokens.shape == (4, 16)
    expected = teacher_forced_logprobs(model, ids, attention, out.tokens, 0.8)
    torch.testing.assert_close(out.logprobs, expected, atol=2e-5, rtol=0)
    assert len(set(map(tuple, out.tokens.tolist()))) == 4  # sampled, not collapsed


def test_rows_end_at_their_first_stop_and_the_loop_ends_when_all_have():
    model = tiny("llama")
    ids, attention = prompts()
    out = decode(model, ids, attention, 1.0, 1.0, 40, list(range(2, VOCAB // 2)), PAD, seed=1)
    stops = (out.tokens >= 2) & (out.tokens < VOCAB // 2)
    first = stops.int().argmax(1)
    assert stops.any(1).all() and out.tokens.shape[1] == int(first.max()) + 1 < 40
    for row, end in enumerate(first.tolist()):
        assert (out.tokens[row, end + 1 :] == PAD).all()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sampled_tokens_equal_hf_generate_with_the_same_seed(kind):
    """The draw is generate's (temperature, top-p, multinomial on the seeded stream), so the
    trajectories measured with HF generate before this loop existed stay what they were."""
    model = tiny(kind)
    ids, attention = prompts()
    config = GenerationConfig(
        do_sample=True, temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=16, pad_token_id=PAD, eos_token_id=[STOP]
    )
    torch.manual_seed(11)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=attention, generation_config=config)[:, ids.shape[1] :]
    out = decode(model, ids, attention, 0.8, 0.9, 16, [STOP], PAD, seed=11)
    assert torch.equal(out.tokens, expected)
    assert len(set(map(tuple, out.tokens.tolist()))) == 4


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_equals_hf_warper(top_p):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(4)) * 3
    expected = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(filter_top_p(logits, top_p), expected)


def test_seed_fixes_the_draw():
    model = tiny("llama")
    ids, attention = prompts()
    a, b, c = (decode(model, ids, attention, 1.0, 1.0, 10, [], PAD, seed=s).tokens for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_weight_update_is_picked_up():
    model = tiny("llama")
    ids, attention = prompts()
    before = decode(model, ids, attention, 0.0, 1.0, 12, [STOP], PAD, 0).tokens
    with torch.no_grad():  # through numpy, as a rollout replica's weight sync writes: no version bump
        model.model.layers[0].mlp.up_proj.weight.numpy()[:] *= -1.5
    assert not torch.equal(decode(model, ids, attention, 0.0, 1.0, 12, [STOP], PAD, 0).tokens, before)
    after = decode(model, ids, attention, 0.0, 1.0, 12, [STOP], PAD, 0).tokens
    assert torch.equal(after, hf_greedy(model, ids, attention, 12))


@pytest.mark.parametrize("modules_to_save", [None, ["embed_tokens"]])  # the tied embedding trained whole
def test_lora_adapters_are_merged_into_what_is_sampled(modules_to_save):
    model = tiny("llama")
    targets = ["q_proj", "v_proj", "down_proj"]
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save))
    for name, p in lora.named_parameters():
        if p.requires_grad:  # B starts at 0 and the saved copy equals the base: make both matter
            p.data.add_(torch.randn_like(p) * 0.5)
    ids, attention = prompts()
    out = decode(lora, ids, attention, 0.7, 1.0, 12, [], PAD, seed=2)
    expected = teacher_forced_logprobs(lora, ids, attention, out.tokens, 0.7)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-4, rtol=0)  # log-probs down to -15 here
    with lora.disable_adapter():
        base = teacher_forced_logprobs(lora, ids, attention, out.tokens, 0.7)
    assert (out.logprobs - base).abs().max() > 0.1


def test_other_models_step_through_their_own_forward():
    assert "bfloat16" in unsupported_reason(tiny("llama").to(torch.bfloat16))
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "gpt2" in unsupported_reason(gpt2)
    ids, attention = prompts()
    out = sample_tokens(gpt2, ids, attention, SamplingParams(0.0, 1.0, 8), [STOP], PAD, seed=0)
    assert torch.equal(out.tokens, hf_greedy(gpt2, ids, attention, 8))
    sampled = sample_tokens(gpt2, ids, attention, SamplingParams(0.9, 1.0, 8), [], PAD, seed=0)
    expected = teacher_forced_logprobs(gpt2, ids, attention, sampled.tokens, 0.9)
    torch.testing.assert_close(sampled.logprobs, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_fast_layer_loop_and_the_models_own_forward_draw_the_same_tokens(kind):
    """`synced` (ZeRO-3's lockstep; one process here) samples through the model's own forward:
    the same draw from logits equal to rounding gives the same tokens, so a ZeRO-3 run and a
    single-process run sample alike."""
    model = tiny(kind)
    ids, attention = prompts()
    fast = decode(model, ids, attention, 1.0, 0.9, 16, [STOP], PAD, seed=8)
    slow = decode(model, ids, attention, 1.0, 0.9, 16, [STOP], PAD, seed=8, synced=True)
    assert torch.equal(fast.tokens, slow.tokens)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=2e-5, rtol=0)
