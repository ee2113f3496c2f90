"""rollout.async's stream (engine/rollout/streaming.py): the staleness bound on every trained row,
the overlap it allows, resume accounting (committed groups kept, in-flight ones discarded and
counted, nothing trained twice), a lowered bound dropping groups, and a real replica that hangs
mid-stream. The real replica under PPO, killed at random: tests/scenarios/test_async_rollout.py."""

import os
import signal
import time

import pytest

from rlflow.engine.config.sampling import SamplingParams
from helpers.hf_replica import hf_client
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.rollout.replica import ReplicaError
from rlflow.engine.rollout.streaming import AsyncSampler, GroupShape, from_ranges, to_ranges
from rlflow.engine.rollout.replica import Generation

PARAMS = SamplingParams(max_new_tokens=6)
SHAPE = GroupShape(size=2, per_step=4, per_request=3)  # requests straddle steps on purpose


class StaleClient:
    """Answers like the worker, as stale as it may be: a request's first token is sampled by the
    weights held when it was submitted, the second (partial rollouts: pause mode keep) by those
    held when it is collected. Each row's ids are [group prompt, row]."""

    def __init__(self):
        self.weights, self.requests, self.next_id = 0, {}, 0
        self.partial = False  # the fleet's pause mode: keep (partial rollouts) or wait

    def submit(self, prompts, params, seed):
        self.requests[self.next_id] = (self.weights, list(prompts), self.partial)
        self.next_id += 1
        return self.next_id - 1

    def collect(self, request_id):
        submitted, prompts, partial = self.requests.pop(request_id)
        second = self.weights if partial else submitted
        return Generation([[p[0], i] for i, p in enumerate(prompts)], [[-1.0, -2.0]] * len(prompts),
                          [[submitted, second]] * len(prompts))  # fmt: skip


def sampler(client, staleness, version=0, state=None, partial=True, last_step=100):
    client.partial = partial
    return AsyncSampler(client, lambda g: [100 + g], PARAMS, SHAPE, staleness, partial, version, last_step, 7, state)


def train(stream, client, first, last):
    """The stage's loop: take the step's groups, train, send the weights (version = step), top up."""
    taken = {}
    for step in range(first, last + 1):
        taken[step] = stream.take(step)
        client.weights = stream.version = step
        stream.top_up()
    return taken


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_no_trained_row_is_staler_than_the_bound_and_the_buffer_runs_that_far_ahead(staleness):
    client = StaleClient()
    stream = sampler(client, staleness)
    stream.top_up()
    assert stream.outstanding == (staleness + 1) * SHAPE.per_step  # submitted before step 1 trains
    taken = train(stream, client, 1, 8)
    for step, groups in taken.items():
        worst = max(step - 1 - min(row) for row in groups.versions)
        assert worst <= staleness
        assert groups.groups == list(range((step - 1) * 4, step * 4))  # in stream order, none skipped
        assert [row[0] for row in groups.response_ids] == [100 + g for g in groups.groups for _ in range(2)]
    if staleness:  # the bound is reached: the worker did sample that far ahead
        assert max(step - 1 - min(min(row) for row in g.versions) for step, g in taken.items()) == staleness
    assert stream.metrics()["rollout/dropped_stale"] == 0


def test_nothing_is_sampled_that_the_last_step_would_not_train():
    client = StaleClient()
    stream = sampler(client, 2, last_step=3)
    stream.top_up()
    train(stream, client, 1, 3)
    assert stream.next_group == 3 * SHAPE.per_step and stream.outstanding == 0


def test_a_step_taken_but_not_trained_goes_back_to_the_buffer_of_a_checkpoint():
    client = StaleClient()
    stream = sampler(client, 1)
    stream.top_up()
    train(stream, client, 1, 2)
    held = stream.take(3)  # a pause before step 3's update: the checkpoint is step 2's
    state = stream.state_dict()
    assert from_ranges(state["fates"]["trained"]) == list(range(8))
    assert [g for group in state["ready"] for g in group["groups"]][:4] == held.groups


def test_a_resumed_stream_keeps_the_committed_groups_discards_those_in_flight_and_trains_nothing_twice():
    client = StaleClient()
    stream = sampler(client, 2)
    stream.top_up()
    train(stream, client, 1, 2)
    stream._collect_one()  # one request's groups ready, the rest in flight
    state = stream.state_dict()
    ready = [g for group in state["ready"] for g in group["groups"]]
    in_flight = from_ranges(state["in_flight"])
    assert ready and in_flight and state["next_group"] == 8 + len(ready) + len(in_flight)

    resumed_client = StaleClient()  # a new worker, with the weights of version 2
    resumed_client.weights = 2
    resumed = sampler(resumed_client, 2, version=2, state=state)
    assert resumed.metrics()["rollout/discarded_on_resume"] == len(in_flight)
    taken = train(resumed, resumed_client, 3, 6)
    trained = [g for step in range(3, 7) for g in taken[step].groups]
    assert trained[: len(ready)] == ready  # the committed groups first, as they were sampled
    assert not set(trained) & set(in_flight) and not set(trained) & set(range(8))
    final = resumed.state_dict()
    fates = {fate: from_ranges(runs) for fate, runs in final["fates"].items()}
    assert fates["discarded"] == in_flight and fates["trained"] == list(range(8)) + trained
    assert len(fates["trained"]) == len(set(fates["trained"])) == 6 * SHAPE.per_step
    waiting = [g for group in final["ready"] for g in group["groups"]] + from_ranges(final["in_flight"])
    assert sorted(fates["trained"] + fates["discarded"] + waiting) == list(range(final["next_group"]))


def test_a_bound_lowered_on_resume_drops_the_groups_it_no_longer_allows_and_counts_them():
    client = StaleClient()
    stream = sampler(client, 2, partial=False)  # whole rows of the submitting version
    stream.top_up()
    train(stream, client, 1, 2)
    while stream.inflight:
        stream._collect_one()
    state = stream.state_dict()  # 12 groups ready: versions 0, 1 and 2 (submitted after each sync)
    versions = [group["versions"][0][0] for group in state["ready"]]
    resumed_client = StaleClient()
    resumed_client.weights = 2
    resumed = sampler(resumed_client, 0, version=2, state=state)
    taken = train(resumed, resumed_client, 3, 4)
    assert all(min(row) == step - 1 for step, g in taken.items() for row in g.versions)  # bound 0 holds
    assert resumed.metrics()["rollout/dropped_stale"] == sum(v < 2 for v in versions) > 0
    dropped = from_ranges(resumed.state_dict()["fates"]["dropped"])
    assert dropped == [g for group, v in zip(state["ready"], versions) if v < 2 for g in group["groups"]]


def test_ranges_round_trip_and_stay_short():
    ids = [0, 1, 2, 3, 7, 8, 12]
    assert to_ranges(ids) == [[0, 4], [7, 9], [12, 13]] and from_ranges(to_ranges(ids)) == ids
    assert to_ranges(list(range(10_000))) == [[0, 10_000]]


# --- a real replica that stops answering mid-stream ------------------------------------------------


def test_a_replica_that_hangs_mid_stream_is_an_error_at_the_response_timeout_and_stays_one(small_assets, tmp_path):
    """(A replica that dies mid-stream: tests/scenarios/test_async_rollout.py kills it under PPO.)"""
    model_dir = str(small_assets / "tiny-model")
    tokenizer = load_tokenizer(model_dir)
    replica, client = hf_client(model_dir, tokenizer, str(tmp_path / "hang.log"), timeout_s=5, pause_mode="keep")
    with client:
        weights = load_policy(model_dir).named_parameters()
        client.update_weights(weights, 0.5, version=0)
        stream = AsyncSampler(client, lambda g: [5 + g % 7, 9], PARAMS, SHAPE, 1, True, 0, 10)
        stream.top_up()
        assert len(stream.take(1).groups) == 4 and stream.inflight  # the stream works, more groups in flight
        client.update_weights(load_policy(model_dir).named_parameters(), 0.5, version=1)  # a sync mid-stream
        os.kill(replica.proc.pid, signal.SIGSTOP)  # alive, never answers
        stream.version = 1  # as the stage's sync does: the stream asks for more
        stream.top_up()
        started = time.monotonic()
        with pytest.raises(ReplicaError) as err:
            for step in range(2, 11):  # the groups sampled before it stopped, then the first it owes
                stream.take(step)
        assert time.monotonic() - started < 30  # a request sent before the stop may time out sooner
        assert "got no answer within 5 s (rollout.response_timeout_s)" in str(err.value)
        assert f"the replica process {replica.proc.pid} is running" in str(err.value)
        with pytest.raises(ReplicaError, match="no answer"):  # and stays an error, never a hang
            client.update_weights(weights, 0.5, version=2)
        os.kill(replica.proc.pid, signal.SIGCONT)
