"""Turning text into padded tensors, and the deterministic order batches are drawn in."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rlflow.engine.data.records import SFTExample, format_prompt
from rlflow.engine.envs.chat import ConversationEncoder
from rlflow.engine.seeds import step_seed


@dataclass(frozen=True)
class PromptResponseIds:
    prompt: list[int]
    response: list[int]  # ends with EOS when the text was complete
    # 1.0 on the response ids that carry loss, 0.0 on the observations between a conversation's
    # assistant turns; None: every response id does.
    learned: tuple[float, ...] | None = None

    def response_mask(self) -> list[float]:
        return list(self.learned) if self.learned is not None else [1.0] * len(self.response)


def encode_pair(
    tokenizer: Any, prompt: Any, response: str, max_tokens: int, tools: Sequence[dict] = ()
) -> PromptResponseIds:
    """Token ids of a formatted prompt (its `tools` schemas shown) and its response + EOS, cut to
    max_tokens in total (the prompt keeps its last tokens; the response keeps at least one token)."""
    prompt_ids = tokenizer(format_prompt(tokenizer, prompt, tools), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    response_ids = response_ids[: max(1, max_tokens - 1)]
    prompt_ids = prompt_ids[-max(1, max_tokens - len(response_ids)) :]
    return PromptResponseIds(prompt_ids, response_ids)


def encode_conversation(
    tokenizer: Any, example: SFTExample, max_tokens: int, encoders: dict[str, ConversationEncoder] | None = None
) -> PromptResponseIds:
    """Ids of a conversation with every assistant turn learned, laid out as a multi-turn episode's
    trajectory is (engine/envs/chat.py): the messages before the first assistant turn rendered
    with the generation prompt, then each assistant turn's text + EOS (learned), then the
    messages up to the next one as the template's observation ids. So SFT trains on the ids RL
    samples from, never on a re-rendering of turns the model writes itself. Cut to max_tokens as
    encode_pair cuts (the later turns go first). `encoders`: reused per tool set across calls."""
    turns = [*example.prompt, {"role": "assistant", "content": example.response}]
    encoders = {} if encoders is None else encoders
    key = json.dumps(example.tools, sort_keys=True)
    if key not in encoders:
        encoders[key] = ConversationEncoder(tokenizer, list(example.tools))
    encoder = encoders[key]
    # An opening assistant turn (nothing before it to answer) stays context.
    first = next(i for i in range(1, len(turns)) if turns[i]["role"] == "assistant")
    prompt, response, learned, between = encoder.prompt_ids(turns[:first]), [], [], []
    eos = tokenizer.eos_token_id
    for turn in turns[first:]:
        if turn["role"] != "assistant":
            between.append(turn)
            continue
        if response:
            observation = encoder.observation_ids(between, eos)
            response, learned, between = response + observation, learned + [0.0] * len(observation), []
        ids = tokenizer(turn["content"], add_special_tokens=False)["input_ids"] + [eos]
        response, learned = response + ids, learned + [1.0] * len(ids)
    keep = max(1, max_tokens - 1)
    response, learned = response[:keep], learned[:keep]
    prompt = prompt[-max(1, max_tokens - len(response)) :]
    return PromptResponseIds(prompt, response, tuple(learned))


def right_pad(rows: Sequence[PromptResponseIds], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate prompt+response per row, right-padded.

    Returns input_ids [B, T], attention_mask [B, T] and response_mask [B, T] (1 on response tokens:
    SFT's loss positions; built from lengths, never from the pad id, so an EOS equal to the pad
    token is still learned).
    """
    width = max(len(r.prompt) + len(r.response) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n_p, n = len(r.prompt), len(r.prompt) + len(r.response)
        ids[i, :n] = torch.tensor(r.prompt + r.response)
        attention[i, :n] = 1
        response_mask[i, n_p:n] = torch.tensor(r.response_mask())
    return ids, attention, response_mask


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt batch for generation: input_ids [B, P], attention_mask [B, P]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(list(r))
        attention[i, width - len(r) :] = 1
    return ids, attention


def batch_indices(n_items: int, batch_size: int, step: int, *seed_parts: int) -> list[int]:
    """Indices of the items for global step `step` (1-based): epochs are seeded permutations.

    A pure function of (seed, step), so a resumed stage draws exactly the batches it would have.
    """
    start = (step - 1) * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n_items)
        generator = torch.Generator().manual_seed(step_seed(*seed_parts, epoch))
        perm = torch.randperm(n_items, generator=generator).tolist()
        out.extend(perm[offset : offset + batch_size - len(out)])
    return out


def bootstrap_weights(n_items: int, n_heads: int, *seed_parts: int) -> torch.Tensor:
    """[n_items, n_heads] float counts: how often each head's bootstrap resample draws each item.

    Poisson(1) per item and head (the online bootstrap: for many items the same distribution as
    drawing n_items with replacement, and each item's count is independent of the others'), a
    pure function of the seed, so a resumed stage trains each head on the same resample. One head
    gets all ones: it trains on every item once, as without an ensemble."""
    if n_heads == 1:
        return torch.ones(n_items, 1)
    generator = torch.Generator().manual_seed(step_seed(*seed_parts, n_heads))
    return torch.poisson(torch.ones(n_items, n_heads), generator=generator)


def rank_shard(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's share of a global batch: every world_size-th item, starting at its rank."""
    return list(indices[rank::world_size])


def micro_batch_groups(
    lengths: Sequence[int], max_rows: int | None, max_tokens: int | None, packed: bool = False
) -> list[list[int]]:
    """Cut positions 0..n-1 into micro-batches.

    max_tokens: dynamic batch size; rows sorted by length are grouped while the micro-batch's
    size stays within the budget (a longer row goes alone), so short rows travel many to a pass
    and long ones few. The size is rows x longest row when padded, the sum of lengths when
    `packed` (rows concatenated without padding). max_rows caps rows per micro-batch either way;
    neither set: one micro-batch holding everything.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if max_tokens else list(range(len(lengths)))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        widest = max([lengths[j] for j in current] + [lengths[i]])
        size = sum(lengths[j] for j in current) + lengths[i] if packed else widest * (len(current) + 1)
        too_many = max_rows is not None and len(current) >= max_rows
        too_big = max_tokens is not None and size > max_tokens
        if current and (too_many or too_big):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class PackedRows:
    """Rows concatenated into one padding-free row; attention stays within each row because
    position ids restart at 0 (transformers builds a block-diagonal causal mask from them when
    no attention mask is given). N rows, T = their total length."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T] 0..len-1 per row
    response_mask: torch.Tensor  # [1, T] float, 1 on response tokens
    ends: torch.Tensor  # [N] position of each row's last token


def pack_rows(rows: Sequence[PromptResponseIds]) -> PackedRows:
    ids, positions, mask, ends, total = [], [], [], [], 0
    for r in rows:
        n = len(r.prompt) + len(r.response)
        ids += r.prompt + r.response
        positions += range(n)
        mask += [0.0] * len(r.prompt) + r.response_mask()
        total += n
        ends.append(total - 1)
    return PackedRows(
        torch.tensor([ids]), torch.tensor([positions]), torch.tensor([mask]), torch.tensor(ends, dtype=torch.long)
    )
