"""Batched sampling from the policy and the typed record it produces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.data.batching import left_pad
from rlflow.engine.models.loading import sequence_scores, token_logprobs, token_values
from rlflow.engine.models.tokens import response_mask_from_ids, stop_token_ids
from rlflow.engine.rollout.decode import Decoded, decode


@dataclass(frozen=True)
class RolloutBatch:
    """Prompts and sampled responses of one step. B rows, P prompt width, R response width."""

    input_ids: torch.Tensor  # [B, P+R] left-padded prompt, then right-padded response
    attention_mask: torch.Tensor  # [B, P+R] 1 on real prompt and response tokens
    response_mask: torch.Tensor  # [B, R] float, 1 up to and including each row's EOS
    prompt_width: int  # P
    response_texts: tuple[str, ...]  # B decoded responses, special tokens removed
    # [B, R] the sampler's log softmax(logits / T) of each response token (the behaviour policy's,
    # before top-p), 0 on padding; None where the producer did not report them (hand-built batches).
    sampled_logprobs: torch.Tensor | None = None
    # [B] int64 the policy version (completed training steps) that sampled each row; None: the
    # trainer's current policy (colocated sampling, hand-built batches).
    sampled_versions: torch.Tensor | None = None

    @property
    def response_ids(self) -> torch.Tensor:  # [B, R]
        return self.input_ids[:, self.prompt_width :]

    def rows(self, index: torch.Tensor) -> RolloutBatch:
        return RolloutBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.response_mask[index],
            self.prompt_width,
            tuple(self.response_texts[i] for i in index.tolist()),
            None if self.sampled_logprobs is None else self.sampled_logprobs[index],
            None if self.sampled_versions is None else self.sampled_versions[index],
        )


def merge_rollouts(parts: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack batches sampled separately (chunks, ranks): prompts re-left-padded to the widest,
    responses re-right-padded to the longest."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.prompt_width for p in parts)
    length = max(p.input_ids.shape[1] - p.prompt_width for p in parts)

    def pad(t: torch.Tensor, p: RolloutBatch, value: int) -> torch.Tensor:
        left, right = width - p.prompt_width, length - (t.shape[1] - p.prompt_width)
        return torch.nn.functional.pad(t, (left, right), value=value)

    return RolloutBatch(
        input_ids=torch.cat([pad(p.input_ids, p, pad_id) for p in parts]),
        attention_mask=torch.cat([pad(p.attention_mask, p, 0) for p in parts]),
        response_mask=pad_responses([p.response_mask for p in parts]),
        prompt_width=width,
        response_texts=tuple(t for p in parts for t in p.response_texts),
        sampled_logprobs=(
            None
            if any(p.sampled_logprobs is None for p in parts)
            else pad_responses([p.sampled_logprobs for p in parts])
        ),
        sampled_versions=(
            None if any(p.sampled_versions is None for p in parts) else torch.cat([p.sampled_versions for p in parts])
        ),
    )


def pad_responses(parts: Sequence[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """Concatenate [b_i, R_i] per-response-token tensors along rows, right-padding to max R_i."""
    length = max(t.shape[1] for t in parts)
    return torch.cat([torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value) for t in parts])


def sample_tokens(
    policy: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    params: SamplingParams,
    stop_ids: Sequence[int],
    pad_id: int,
    seed: int,
    synced_gpus: bool = False,
    interrupt: Callable[[], bool] | None = None,
) -> Decoded:
    """Responses [B, R] to left-padded prompts `ids` [B, P] and their log-probs under
    softmax(logits / T) (engine/rollout/decode.py); `seed` fixes the draw exactly. `synced_gpus`: ZeRO-3's
    lockstep (Runtime.generate_kwargs); `interrupt`: decode's, a partial rollout's cut."""
    was_training = policy.training
    policy.eval()
    try:
        sampling = (params.temperature, params.top_p, params.max_new_tokens)
        return decode(policy, ids, attention, *sampling, stop_ids, pad_id, seed, synced_gpus, interrupt)
    finally:
        policy.train(was_training)


@torch.no_grad()
def generate_rollouts(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seed: int,
    **generate_kwargs: Any,
) -> RolloutBatch:
    """Sample one response per prompt (`sample_tokens`); `seed` fixes the draw exactly.

    generate_kwargs: backend extras (`synced_gpus` under ZeRO-3)."""
    ids, attention = left_pad(prompts, tokenizer.pad_token_id)
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id
    decoded = sample_tokens(policy, ids, attention, params, stops, pad, seed, **generate_kwargs)
    response = decoded.tokens
    mask = response_mask_from_ids(response, stops)
    response = torch.where(mask.bool(), response, torch.full_like(response, tokenizer.pad_token_id))
    texts = tuple(tokenizer.batch_decode(response, skip_special_tokens=True))
    return RolloutBatch(
        input_ids=torch.cat([ids, response], 1),
        attention_mask=torch.cat([attention, mask.long()], 1),
        response_mask=mask,
        prompt_width=ids.shape[1],
        response_texts=texts,
        sampled_logprobs=decoded.logprobs * mask,
    )


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float, chunk: int = 64) -> torch.Tensor:
    """Response log-probs [B, R] under `model` (no grad), computed in row chunks."""
    parts = []
    for i in range(0, batch.input_ids.shape[0], chunk):
        lp, _ = token_logprobs(
            model, batch.input_ids[i : i + chunk], batch.attention_mask[i : i + chunk], batch.prompt_width, temperature
        )
        parts.append(lp.cpu())
    return torch.cat(parts) * batch.response_mask


@torch.no_grad()
def batched_values(critic: torch.nn.Module, batch: RolloutBatch, chunk: int = 64) -> torch.Tensor:
    """Critic values [B, R]: position t's value is read at the token before response token t."""
    parts = []
    for i in range(0, batch.input_ids.shape[0], chunk):
        v = token_values(critic, batch.input_ids[i : i + chunk], batch.attention_mask[i : i + chunk])
        parts.append(v[:, batch.prompt_width - 1 : -1].cpu())
    return torch.cat(parts) * batch.response_mask


@torch.no_grad()
def batched_scores(reward_model: torch.nn.Module, batch: RolloutBatch, chunk: int = 64) -> torch.Tensor:
    """Raw reward-model scores [B] at each row's last response token."""
    return torch.cat(
        [
            sequence_scores(reward_model, batch.input_ids[i : i + chunk], batch.attention_mask[i : i + chunk]).cpu()
            for i in range(0, batch.input_ids.shape[0], chunk)
        ]
    )
