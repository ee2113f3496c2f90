"""The off-policy schedule (engine/rollout/lookahead.py): which version samples each step, that a
resumed lookahead continues exactly, the staleness bound, and the chunking of a step."""

import json

import pytest
import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.lookahead import Lookahead, StepPlan, chunk_spans, staleness_metrics
from rlflow.engine.rollout.replica import Generation
from rlflow.engine.seeds import step_seed

PARAMS = SamplingParams()


class VersionedClient:
    """Answers in order like the worker; each sample encodes (weights version, seed, prompt), so a
    test can read which weights sampled which request. The real worker: tests/scenarios."""

    def __init__(self):
        self.weights, self.pending, self.submitted = 0, [], []

    def submit(self, prompts, params, seed):
        self.pending.append((self.weights, seed, [list(p) for p in prompts]))
        self.submitted.append(seed)

    def collect(self):
        weights, seed, prompts = self.pending.pop(0)
        return Generation([[weights, seed, *p] for p in prompts], [[-0.5 * weights - 1e-3 * seed] for _ in prompts])


def plan(step: int) -> StepPlan:
    prompts = [(step, row) for row in range(5)]
    return StepPlan(chunk_spans(prompts, 1000 + step, 2), PARAMS)


def run(lookahead: Lookahead, client: VersionedClient, first: int, last: int) -> dict[int, object]:
    """The stage's loop: take the step, train it, drain, send the new weights."""
    taken = {}
    for step in range(first, last + 1):
        taken[step] = lookahead.take(step)
        lookahead.drain()
        client.weights = lookahead.version = step
    return taken


@pytest.mark.parametrize("k", [1, 2, 3])
def test_step_t_is_sampled_by_version_max_0_t_minus_1_minus_k_whatever_the_order_of_replies(k):
    client = VersionedClient()
    taken = run(Lookahead(client, k, plan, last_step=7, version=0), client, 1, 7)
    for step, sampled in taken.items():
        expected = max(0, step - 1 - k)
        assert sampled.version == expected
        ids = [row for ids, _ in sampled.chunks for row in ids]
        assert [row[0] for row in ids] == [expected] * 5  # the weights the fake worker really held
        assert [tuple(row[2:]) for row in ids] == [p for _, prompts, _ in plan(step).chunks for p in prompts]
    # each step submitted once, never past the last step
    assert sorted(client.submitted) == sorted(seed for s in range(1, 8) for _, _, seed in plan(s).chunks)


@pytest.mark.parametrize("k", [1, 2])
def test_a_lookahead_restored_from_its_json_state_continues_exactly(k):
    client = VersionedClient()
    uninterrupted = run(Lookahead(client, k, plan, 6, 0), client, 1, 6)

    first = VersionedClient()
    before = Lookahead(first, k, plan, 6, 0)
    run(before, first, 1, 3)
    state = json.loads(json.dumps(before.state_dict()))  # what the checkpoint file holds
    assert sorted(int(s) for s in state) == list(range(4, 4 + k))

    second = VersionedClient()
    second.weights = 3  # the restarted worker gets the resumed actor's weights
    after = run(Lookahead(second, k, plan, 6, 3, Lookahead.buffer_from(state)), second, 4, 6)
    for step in range(4, 7):
        assert after[step] == uninterrupted[step]


def test_state_dict_refuses_with_generations_outstanding_and_take_names_an_unplanned_step():
    client = VersionedClient()
    lookahead = Lookahead(client, 2, plan, 5, 0)
    lookahead.take(1)  # steps 2 and 3 still in flight
    with pytest.raises(RuntimeError, match="drain"):
        lookahead.state_dict()
    lookahead.drain()
    assert lookahead.waited_s >= 0
    lookahead.take(2)
    with pytest.raises(RuntimeError, match="step 1's samples were never submitted"):
        lookahead.take(1)


def test_staleness_metrics_against_hand_values_and_the_bound():
    out = staleness_metrics(torch.tensor([3, 3, 2, 4]), trainer_version=4, bound=2)
    assert out == {"rollout/staleness_mean": pytest.approx((1 + 1 + 2 + 0) / 4), "rollout/staleness_max": 2.0}
    with pytest.raises(RuntimeError, match=r"staleness must lie in \[0, 1\]"):
        staleness_metrics(torch.tensor([2, 4]), trainer_version=4, bound=1)
    with pytest.raises(RuntimeError, match="versions \\[5\\]"):
        staleness_metrics(torch.tensor([5]), trainer_version=4, bound=3)  # from the future


def test_chunk_spans_cut_prompts_and_seed_chunk_c_with_seed_c():
    prompts = [(i,) for i in range(5)]
    spans = chunk_spans(prompts, 77, 2)
    assert [(c, list(p)) for c, p, _ in spans] == [(0, [(0,), (1,)]), (1, [(2,), (3,)]), (2, [(4,)])]
    assert [seed for _, _, seed in spans] == [step_seed(77, c) for c in range(3)]


def test_a_probe_is_answered_in_its_turn_and_kept_apart_from_the_steps():
    client = VersionedClient()
    lookahead = Lookahead(client, 1, plan, 4, 0)
    lookahead.take(1)  # step 2 in flight
    with pytest.raises(RuntimeError, match="no probe submitted"):
        lookahead.collect_probe()
    lookahead.drain()
    client.weights = lookahead.version = 1
    lookahead.submit_probe([(9, 9)], PARAMS, 555)
    sampled = lookahead.take(2)  # submits step 3 behind the probe; step 2 was buffered
    assert sampled.version == 0 and lookahead.probe is None
    probe = lookahead.collect_probe()
    assert probe.response_ids == [[1, 555, 9, 9]]  # sampled first, by the weights just sent
    assert lookahead.take(3).version == 1
