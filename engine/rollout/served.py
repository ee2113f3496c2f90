"""A replica's samples as the trainer's batches.

    generation = client.generate(prompts, params, seed)
    batch = build_rollout_batch(tokenizer, prompts, generation, params.max_new_tokens)

Kept apart from engine/rollout/replica.py (the replica's client and its requests): this side
knows masks and the trainer's policy, the client knows none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rlflow.engine.data.batching import left_pad
from rlflow.engine.models.tokens import response_mask_from_ids, stop_token_ids
from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.rollout.replica import ReplicaError
from rlflow.engine.rollout.replica import Generation


def build_rollout_batch(
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    generation: Generation,
    max_new_tokens: int,
    version: int | None = None,
) -> RolloutBatch:
    """The RolloutBatch `generate_rollouts` would build from these prompts and the worker's samples.

    Same left padding, same right padding with pad_token_id after each row's EOS, same response
    mask (1 up to and including the first EOS). Width R = the longest response. The worker's
    log-probs become sampled_logprobs (0 on padding); `version`, the policy version the worker
    held, becomes every row's sampled_versions; None: each row's oldest token's version where the
    generation tags them (a partial rollout spans several), else left unset.
    """
    response_ids = generation.response_ids
    pad, stops = tokenizer.pad_token_id, stop_token_ids(tokenizer)
    ids, attention = left_pad(prompts, pad)
    width = max(len(r) for r in response_ids)
    response = torch.full((len(response_ids), width), pad, dtype=torch.long)
    for i, row in enumerate(response_ids):
        if len(row) < max_new_tokens and (not row or row[-1] not in stops):
            raise ReplicaError(
                f"the rollout replica returned a {len(row)}-token response without EOS"
                f" (max_new_tokens={max_new_tokens});"
                " the replica's stop condition differs from the trainer's: check the model's eos_token_id"
            )
        response[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
    mask = response_mask_from_ids(response, stops)
    response = torch.where(mask.bool(), response, torch.full_like(response, pad))
    logprobs = torch.zeros(mask.shape)
    for i, row in enumerate(generation.logprobs):
        logprobs[i, : len(row)] = torch.tensor(row)
    return RolloutBatch(
        input_ids=torch.cat([ids, response], 1),
        attention_mask=torch.cat([attention, mask.long()], 1),
        response_mask=mask,
        prompt_width=ids.shape[1],
        response_texts=tuple(tokenizer.batch_decode(response, skip_special_tokens=True)),
        sampled_logprobs=logprobs * mask,
        sampled_versions=_row_versions(generation, version),
    )


def _row_versions(generation: Generation, version: int | None) -> torch.Tensor | None:
    """[B] int64: the version that sampled each row (its oldest token's)."""
    if version is not None:
        return torch.full((len(generation.response_ids),), version, dtype=torch.long)
    if generation.versions is None:
        return None
    return torch.tensor([min(row) for row in generation.versions], dtype=torch.long)
