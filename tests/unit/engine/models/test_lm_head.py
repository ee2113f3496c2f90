"""The LM head in chunks (engine/models/lm_head.py): the same log-probs, entropies, values and gradients
as full-width logits, and no [B, T, V] tensor kept alive for the backward pass."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.engine.config.model import LoraConfig
from rlflow.engine.models.lm_head import next_token_logprobs
from rlflow.engine.models.lora import AdaptersOffView, apply_lora
from rlflow.engine.models.loading import position_ids_from_mask, token_values

VOCAB = 397  # odd, so chunks of 7 positions never line up with anything


def tiny_llama(tied: bool = True, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).float()


def batch(rows: int = 3, width: int = 11, seed: int = 1) -> tuple[torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, width), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, {"attention_mask": mask, "position_ids": position_ids_from_mask(mask), "use_cache": False}


def run(model, ids, forward, chunk, start=4, temperature=0.7):
    """(log-probs, entropies, gradient of a loss using both, by parameter name)."""
    model.zero_grad()
    logprobs, entropy = next_token_logprobs(model, ids, forward, start, temperature, True, chunk_tokens=chunk)
    weights = torch.linspace(-1, 1, logprobs.numel()).reshape(logprobs.shape)
    ((logprobs * weights).sum() + 0.3 * entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


def assert_same(a, b):
    """Within 1e-6, absolute or relative: a [N, H] matmul rounds differently from a [B, K, H] one
    in the last bit of fp32 (entropies near 6 nats: one ulp is 4.8e-7)."""
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert a[2].keys() == b[2].keys() and a[2]
    for name in a[2]:
        diff = (a[2][name] - b[2][name]).abs().max().item()
        assert diff <= 1e-6 + 1e-6 * b[2][name].abs().max().item(), (name, diff)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_logprobs_entropy_and_gradients_equal_full_logits(tied, chunk):
    model = tiny_llama(tied)
    ids, forward = batch()
    whole = run(model, ids, forward, None)
    assert_same(run(model, ids, forward, chunk), whole)
    # and the whole path agrees with a log-softmax written out by hand
    logits = model(input_ids=ids, **forward).logits[:, 3:-1] / 0.7
    by_hand = logits.log_softmax(-1).gather(-1, ids[:, 4:, None]).squeeze(-1)
    torch.testing.assert_close(whole[0], by_hand.detach(), atol=1e-6, rtol=0)


def test_lora_policy_and_its_adapters_off_reference_chunk_exactly():
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear", modules_to_save=["embed_tokens"])
    model = apply_lora(tiny_llama(), lora)
    with torch.no_grad():  # adapters and the trained embedding copy away from the base
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    ids, forward = batch()
    assert_same(run(model, ids, forward, 5), run(model, ids, forward, None))
    reference = AdaptersOffView(model)
    chunked, _ = next_token_logprobs(reference, ids, forward, 4, chunk_tokens=5)
    whole, _ = next_token_logprobs(reference, ids, forward, 4, chunk_tokens=None)
    adapted, _ = next_token_logprobs(model, ids, forward, 4, chunk_tokens=5)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    assert (chunked - adapted).abs().max() > 1e-3  # the view really ran the head with its adapters off


def test_values_and_their_gradients_do_not_depend_on_the_chunking(small_assets):
    """A critic's per-token values come from its scalar head, never from vocabulary logits: the
    same numbers and gradients whatever the LM head's chunking."""
    from rlflow.engine.models import lm_head
    from rlflow.engine.models.loading import load_scalar_model

    critic = load_scalar_model(str(small_assets / "tiny-model"))
    ids, forward = batch(width=9)
    ids = ids % critic.config.vocab_size
    results = []
    for chunk in (None, 3):
        lm_head.CHUNK_TOKENS, saved = chunk, lm_head.CHUNK_TOKENS
        try:
            critic.zero_grad()
            values = token_values(critic, ids, forward["attention_mask"])
            values.sum().backward()
            results.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}))
        finally:
            lm_head.CHUNK_TOKENS = saved
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], atol=1e-6, rtol=0)


def saved_logit_elements(model, ids, forward, chunk) -> int:
    """Elements of the vocabulary-wide tensors (a dimension of V: logits, log-softmax) that
    autograd saves for the backward pass of one log-prob loss; the weights aside."""
    sizes, weights = [], {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.data_ptr() not in weights and VOCAB in tensor.shape and tensor.numel() > VOCAB:
            sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = next_token_logprobs(model, ids, forward, 1, chunk_tokens=chunk)
    logprobs.sum().backward()
    return sum(sizes)


def test_no_full_width_logits_are_kept_for_the_backward_pass(monkeypatch):
    from rlflow.engine.models import lm_head

    model = tiny_llama()
    ids, forward = batch(rows=4, width=40)
    full = 4 * 39 * VOCAB  # one fp32 [B, T, V]
    monkeypatch.setattr(lm_head, "MAX_KEPT_LOGITS", full - 1)
    assert saved_logit_elements(model, ids, forward, None) >= full  # the unchunked path keeps them
    assert saved_logit_elements(model, ids, forward, 16) == 0  # chunks are recomputed in the backward


def test_small_heads_keep_their_chunks_with_the_same_results_bit_for_bit(monkeypatch):
    """Up to MAX_KEPT_LOGITS logits the chunks are kept for the backward, not recomputed: a saving
    of time only, so log-probs, entropies and every gradient equal the recomputed path's exactly."""
    from rlflow.engine.models import lm_head

    model = tiny_llama()
    ids, forward = batch(rows=4, width=40)
    full = 4 * 39 * VOCAB
    results = {}
    for bound in (full - 1, full):  # one logit over the bound: recomputed; at it: kept
        monkeypatch.setattr(lm_head, "MAX_KEPT_LOGITS", bound)
        results[bound] = run(model, ids, forward, 16, start=1)
        kept = saved_logit_elements(model, ids, forward, 16)
        assert (kept > 0) == (bound == full), (bound, kept)
    recomputed, kept = results[full - 1], results[full]
    assert torch.equal(recomputed[0], kept[0]) and torch.equal(recomputed[1], kept[1])
    assert recomputed[2].keys() == kept[2].keys()
    assert all(torch.equal(recomputed[2][name], kept[2][name]) for name in kept[2])
