"""Dynamic sampling on hand-built rollouts: which groups a step keeps, in which order, how many
tries it makes and how a short batch is filled (the sampler itself: test_step.py)."""

import dataclasses

import torch

from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.stages.rl.dynamic_sampling import sample_informative
from rlflow.engine.stages.rl.experience import Objective, ScoredRollout

N = 2  # samples per group


def rollout(scores, tag, width=1):
    """Rows whose single prompt token is `tag` x 10 + row (so every kept row can be traced back),
    response `width` tokens."""
    rows = len(scores)
    prompt = torch.tensor([[tag * 10 + i] for i in range(rows)])
    response = torch.full((rows, width), 7)
    batch = RolloutBatch(
        torch.cat([prompt, response], 1),
        torch.ones(rows, 1 + width, dtype=torch.long),
        torch.ones(rows, width),
        1,
        tuple(f"{tag}.{i}" for i in range(rows)),
        torch.zeros(rows, width),
    )
    return ScoredRollout(batch, torch.zeros(rows, width), torch.tensor(scores), None, None)


def run(tries_scores, groups, max_tries, objective=Objective(group_size=N)):
    calls = []

    def sample(attempt):
        calls.append(attempt)
        return rollout(tries_scores[attempt], attempt, width=attempt + 1)

    out, metrics = sample_informative(sample, objective, groups, max_tries, pad_id=0)
    return out, metrics, calls


def tags(out):
    return out.batch.input_ids[:, 0].tolist()


def test_enough_informative_groups_on_the_first_try_take_one_sampling():
    out, metrics, calls = run([[1.0, 0.0, 1.0, 1.0, 0.0, 1.0]], groups=2, max_tries=3)
    assert calls == [0]
    assert tags(out) == [0, 1, 4, 5]  # groups 0 and 2; group 1 scored 1, 1
    assert metrics == {"rollout/filtered_groups": 1.0, "rollout/sampling_tries": 1.0, "rollout/underfilled_groups": 0.0}


def test_a_short_batch_samples_again_and_keeps_the_order_sampled():
    first = [1.0, 1.0, 0.0, 1.0]  # group 1 informative
    second = [0.0, 0.0, 0.5, 0.0]  # group 1 informative
    out, metrics, calls = run([first, second], groups=2, max_tries=3)
    assert calls == [0, 1]
    assert tags(out) == [2, 3, 12, 13]
    assert out.batch.input_ids.shape == (4, 3)  # re-padded to the second try's 2 response tokens
    assert out.batch.response_mask.sum(1).tolist() == [1.0, 1.0, 2.0, 2.0]
    assert out.scores.tolist() == [0.0, 1.0, 0.5, 0.0]
    assert metrics["rollout/filtered_groups"] == 2.0 and metrics["rollout/underfilled_groups"] == 0.0


def test_after_the_last_try_dropped_groups_fill_the_batch():
    equal = [1.0, 1.0, 0.0, 0.0]
    out, metrics, calls = run([equal, [0.0, 1.0, 2.0, 2.0]], groups=2, max_tries=2)
    assert calls == [0, 1]
    # the one informative group, then the first dropped group of the first try
    assert tags(out) == [10, 11, 0, 1]
    assert metrics == {"rollout/filtered_groups": 3.0, "rollout/sampling_tries": 2.0, "rollout/underfilled_groups": 1.0}


def test_the_overlong_penalty_counts_in_what_is_informative():
    # equal raw scores, but the second row of group 0 reached the 1-token budget (buffer 1: penalty -1)
    scores = [1.0, 1.0, 0.0, 0.0]
    objective = Objective(group_size=N, overlong_buffer=1, sampling=Objective().sampling)
    budget = objective.sampling.max_new_tokens
    r = rollout(scores, 0, width=budget)
    mask = torch.ones(4, budget)
    mask[0, 1:] = 0  # row 0 ended early: no penalty; rows 1-3 used the budget
    batch = dataclasses.replace(r.batch, response_mask=mask)
    r = dataclasses.replace(r, batch=batch)
    out, metrics = sample_informative(lambda attempt: r, objective, 1, 1, pad_id=0)
    assert tags(out) == [0, 1] and metrics["rollout/filtered_groups"] == 1.0
