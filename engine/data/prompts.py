"""A stage's prompt set: its prompt records, formatted and tokenized under data.max_prompt_tokens and
data.prompt_overflow, as the RL stage, online labelling and evaluation sample them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlflow.engine.data.records import PromptRecord, apply_overflow, encode_prompts, format_prompt
from rlflow.engine.errors import DataError


@dataclass(frozen=True)
class PromptSet:
    records: tuple[PromptRecord, ...]
    token_ids: tuple[tuple[int, ...], ...]


class EpisodePrompts(Protocol):
    """What turns a prompt record into an episode's first messages (engine/rollout/episodes.py EpisodeSampler)."""

    def prompt_ids(self, records: Sequence[PromptRecord]) -> list[list[int]]: ...


def encode_prompt_set(
    tokenizer: Any, records: Sequence[PromptRecord], max_tokens: int, overflow: str, source: str,
    episodes: EpisodePrompts | None = None,
) -> tuple[PromptSet, int, int]:
    """Format and tokenize prompts; returns the kept set and (n_truncated, n_dropped). With
    `episodes` a prompt is an episode's first messages, tool instructions included (what the
    model reads), and the episode sampler truncates them as the overflow policy says.

    Raises DataError naming `source` (the data file) when no prompt is left."""
    if episodes is None:
        encoded = encode_prompts(tokenizer, [format_prompt(tokenizer, r.prompt) for r in records], max_tokens, overflow)
    else:
        encoded = apply_overflow(episodes.prompt_ids(records), max_tokens, overflow)
    if not encoded.token_ids:
        what = "every prompt"
        if episodes is not None:
            what += ", as an episode's first messages (tool instructions included),"
        raise DataError(
            f"{source}: {what} is longer than data.max_prompt_tokens={max_tokens} and was dropped; "
            "raise the limit or set data.prompt_overflow=truncate"
        )
    kept = tuple(records[i] for i in encoded.kept_indices)
    return PromptSet(kept, tuple(tuple(t) for t in encoded.token_ids)), encoded.n_truncated, encoded.n_dropped
