"""The worker's samples as the trainer reads them: a generate reply's ragged payload, one row per prompt,
with the policy version of every token."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


class Generation(NamedTuple):
    """The worker's samples, one entry per prompt; each response ends at its EOS (kept) or the length limit."""

    response_ids: list[list[int]]
    logprobs: list[list[float]]  # log softmax(logits / T) of each sampled token, by the worker
    # the policy version that sampled each token (several in a row a partial rollout continued
    # across weight updates); None where the reply did not say
    versions: list[list[int]] | None = None


def generation_from_reply(reply: dict[str, Any], payload: memoryview) -> Generation:
    """A generate reply (`lengths`, optional `segments`) and its payload: int64 ids of all rows back
    to back, then their float32 log-probs (docs/rollout-protocol.md)."""
    lengths = [int(n) for n in reply["lengths"]]
    total = sum(lengths)
    ids = torch.frombuffer(payload, dtype=torch.int64, count=total).tolist() if total else []
    logprobs = torch.frombuffer(payload, dtype=torch.float32, count=total, offset=8 * total).tolist() if total else []
    starts = [0, *itertools.accumulate(lengths)][:-1]
    versions = None
    if "segments" in reply:
        versions = [token_versions(segs, n) for segs, n in zip(reply["segments"], lengths)]
    return Generation(
        [ids[s : s + n] for s, n in zip(starts, lengths)],
        [logprobs[s : s + n] for s, n in zip(starts, lengths)],
        versions,
    )


def token_versions(segments: Sequence[Sequence[int]], length: int) -> list[int]:
    """Per-token versions of one response from its segments [[first token, version], ...]."""
    out: list[int] = []
    for (_, version), nxt in zip(segments, [*segments[1:], [length, None]]):
        out += [int(version)] * (min(int(nxt[0]), length) - len(out))
    return out
