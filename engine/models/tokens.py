"""Which token ids end a response and which one pads: the roles a chat model's files give them.

A chat model ends its turn with an end-of-turn token (`<|im_end|>`) that its generation config
may list beside the tokenizer's EOS (Qwen2.5: [151645, 151643]). Sampling stops on any of them and
a response's mask ends at the first. Padding is masked out everywhere (masks come from lengths),
but a pad id that doubles as a stop id makes padded rows look finished to HF `generate`; so the pad
is an existing special token outside the stop set, and EOS only when there is none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch

STOP_IDS_ATTR = "rlflow_stop_token_ids"  # set on a tokenizer by models.load_tokenizer


def generation_config_stop_ids(model_dir: str) -> tuple[int, ...]:
    """The `eos_token_id` (an int or a list) of a model directory's generation_config.json; ()
    when the directory has none (a hub id, or a model saved without one)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path, encoding="utf-8") as f:
        value = json.load(f).get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def merge_ids(*groups: Iterable[int | None]) -> tuple[int, ...]:
    """The ids of every group in order of first appearance, None dropped."""
    seen: dict[int, None] = {}
    for group in groups:
        for token in group:
            if token is not None:
                seen.setdefault(int(token), None)
    return tuple(seen)


def choose_pad_id(pad_id: int | None, special_ids: Iterable[int], stop_ids: tuple[int, ...]) -> int:
    """The tokenizer's pad if it is not a stop id, else the first special token outside the stop
    set (no token is ever added: that would need an embedding row the model lacks), else EOS."""
    if pad_id is not None and pad_id not in stop_ids:
        return pad_id
    spare = [t for t in special_ids if t not in stop_ids]
    return spare[0] if spare else stop_ids[0]


def configure_token_roles(tokenizer: Any, model_dir: str | None) -> Any:
    """Set the stop ids (tokenizer EOS, then the generation config's) and the pad token in place."""
    stop = merge_ids([tokenizer.eos_token_id], generation_config_stop_ids(model_dir) if model_dir else ())
    setattr(tokenizer, STOP_IDS_ATTR, stop)
    # Preferred spares: the unknown token (never sampled on purpose), then any other, BOS last.
    bos = tokenizer.bos_token_id
    others = [t for t in tokenizer.all_special_ids if t not in (tokenizer.unk_token_id, bos)]
    pad = choose_pad_id(tokenizer.pad_token_id, merge_ids([tokenizer.unk_token_id], others, [bos]), stop)
    if pad != tokenizer.pad_token_id:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    return tokenizer


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a response: as configured by load_tokenizer, else the tokenizer's EOS."""
    return getattr(tokenizer, STOP_IDS_ATTR, None) or (int(tokenizer.eos_token_id),)


def response_mask_from_ids(response_ids: torch.Tensor, stop_ids: int | Iterable[int]) -> torch.Tensor:
    """[B, R] ids -> [B, R] float mask: 1 up to and including the first stop id (or all, if none)."""
    stops = torch.tensor([stop_ids] if isinstance(stop_ids, int) else list(stop_ids), dtype=response_ids.dtype)
    is_stop = torch.isin(response_ids, stops.to(response_ids.device)).long()
    stops_before = is_stop.cumsum(-1) - is_stop  # stop tokens strictly before each position
    return (stops_before == 0).float()
