"""DAPO's dynamic sampling (`algorithm.dynamic_sampling`): a step trains on groups whose samples
did not all score the same, sampling more prompts while too few of them did.

A group of equal rewards has zero group-relative advantage: it costs a forward and a backward, adds
its tokens to the loss's normaliser and teaches nothing. Late in training, when most prompts are
solved every time (or never), most of a batch can be such groups. Each try samples a fresh set of
`rl.rollout_batch` prompts (prompts and seeds are a pure function of the step and the try, so a
resumed step draws the same). The batch keeps its size: the first rollout_batch informative groups,
in the order sampled, or, after `dynamic_sampling_max_tries`, every informative group found and
then dropped ones to fill it (the step never fails for want of signal, and mini-batches still tile it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.engine.algorithms.dapo import informative_groups
from rlflow.engine.stages.rl.experience import Objective, ScoredRollout


def _group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices [len(groups) x n] of the groups `groups` [G] (consecutive rows per group)."""
    return (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)


def sample_informative(
    sample: Callable[[int], ScoredRollout],
    objective: Objective,
    groups: int,
    max_tries: int,
    pad_id: int,
) -> tuple[ScoredRollout, dict[str, float]]:
    """A rollout of `groups` groups of `objective.group_size` rows: `sample(try)` (try 0, 1, ...)
    returns `groups` freshly sampled and scored groups; informative ones (rewards, with the
    overlong penalty, not all equal) are kept until there are enough or `max_tries` tries were made.

    Returns the rollout and rollout/filtered_groups (groups dropped over all tries),
    rollout/sampling_tries and rollout/underfilled_groups (dropped groups used to fill the batch)."""
    n = objective.group_size
    kept: list[ScoredRollout] = []
    dropped: list[ScoredRollout] = []
    found = filtered = tries = 0
    while found < groups and tries < max_tries:
        rollout = sample(tries)
        tries += 1
        useful = informative_groups(objective.shaped_scores(rollout.scores, rollout.batch), n)
        filtered += int((~useful).sum())
        take = torch.nonzero(useful).flatten()[: groups - found]
        found += len(take)
        kept.append(rollout.rows(_group_rows(take, n)))
        dropped.append(rollout.rows(_group_rows(torch.nonzero(~useful).flatten(), n)))
    short = groups - found
    if short:
        spare = ScoredRollout.concat(dropped, pad_id)
        kept.append(spare.rows(torch.arange(short * n)))
    metrics = {
        "rollout/filtered_groups": float(filtered),
        "rollout/sampling_tries": float(tries),
        "rollout/underfilled_groups": float(short),
    }
    return ScoredRollout.concat([k for k in kept if k.scores.numel()], pad_id), metrics
