"""The HF replica's sampler in this process, on the tiny demo model: rows gathered into their batch and
sampled as colocated generation samples it, a priority batch first, rows alone with their own seed,
pause modes, and what it refuses."""

from __future__ import annotations

import time

import pytest
import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import sample_tokens
from rlflow.engine.rollout.hf_sampler import BatchKey, HFSampler, RowRequest, SamplerError
from rlflow.engine.data.batching import left_pad

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
STOPS = [2]


def rows(batch: str, seed: int, priority: bool = False, prompts=PROMPTS, max_tokens: int = 6) -> list[RowRequest]:
    key = BatchKey(batch, len(prompts), seed, 0, priority)
    return [RowRequest(p, 1.0, 1.0, max_tokens, 1000 + i, STOPS, i, key) for i, p in enumerate(prompts)]


def colocated(model, prompts, seed: int, max_tokens: int = 6):
    ids, attention = left_pad(prompts, 0)
    out = sample_tokens(model, ids, attention, SamplingParams(1.0, 1.0, max_tokens), STOPS, 0, seed)
    return out.tokens, out.logprobs


def test_a_batchs_rows_wait_for_each_other_and_are_sampled_as_one_colocated_batch(hf_model):
    sampler = HFSampler(hf_model, timeout_s=30)
    requests = rows("a", seed=3)
    futures = [sampler.submit(r) for r in reversed(requests)]  # arrival order does not matter
    results = [f.result(30) for f in reversed(futures)]
    tokens, logprobs = colocated(hf_model.model, PROMPTS, seed=3)
    for i, result in enumerate(results):
        n = len(result.ids)
        assert result.ids == tokens[i, :n].tolist() and result.logprobs == logprobs[i, :n].tolist()
        assert n == 6 or result.ids[-1] in STOPS
        assert result.spans == [{"version": "default", "start": 0, "end": n}]
    assert sampler.generations == 1


def test_a_row_without_a_batch_samples_alone_with_its_own_seed(hf_model):
    sampler = HFSampler(hf_model, timeout_s=30)
    alone = sampler.submit(RowRequest(PROMPTS[1], 1.0, 1.0, 6, 77, STOPS)).result(30)
    tokens, _ = colocated(hf_model.model, [PROMPTS[1]], seed=77)
    assert alone.ids == tokens[0, : len(alone.ids)].tolist()


def test_a_priority_batch_goes_before_the_batches_waiting(hf_model):
    sampler = HFSampler(hf_model, timeout_s=30)
    sampler.pause("wait")  # nothing starts until every batch is queued
    order = []
    for name, priority in (("first", False), ("second", False), ("probe", True)):
        for future in [sampler.submit(r) for r in rows(name, seed=1, priority=priority)]:
            future.add_done_callback(lambda _, name=name: order.append(name))
    sampler.resume()
    deadline = time.monotonic() + 30
    while len(order) < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order[::3] == ["probe", "first", "second"]


def test_pause_wait_returns_once_the_running_batch_is_done_and_keep_cuts_it(hf_model):
    sampler = HFSampler(hf_model, timeout_s=30)
    long = rows("long", seed=2, max_tokens=400, prompts=[[5, 6, 7]] * 4)
    for r in long:
        r2 = RowRequest(r.prompt, r.temperature, r.top_p, r.max_tokens, r.seed, [10**6], r.row, r.key)
        future = sampler.submit(r2)  # no stop id: every row samples its 400 tokens
    deadline = time.monotonic() + 60
    while sampler.rows_running != 4:  # the batch is being sampled
        assert time.monotonic() < deadline, "the sampler never took the batch"
        time.sleep(0.005)
    sampler.pause("keep")  # returns once the batch is held, cut after its next token
    assert not sampler.running and not future.done()
    sampler.version = "run:1"
    sampler.resume()
    result = future.result(60)
    assert len(result.ids) == 400 and [s["version"] for s in result.spans] == ["default", "run:1"]
    assert result.spans[0]["end"] == result.spans[1]["start"] > 0
    sampler.pause("wait")
    assert not sampler.running


def test_what_the_sampler_refuses_it_names(hf_model):
    sampler = HFSampler(hf_model, timeout_s=30)
    with pytest.raises(SamplerError, match=r"pause mode 'abort' is not served by the HF replica; use one of"):
        sampler.pause("abort")
    with pytest.raises(SamplerError, match=r"/update_weights needs a paused replica: POST /pause first"):
        sampler.require_paused("/update_weights")
    bad = rows("b", seed=0)[0]
    sampler.submit(bad)
    with pytest.raises(SamplerError, match=r"row 0 of batch 'b' \(3 rows\) is out of range or was sent twice"):
        sampler.submit(bad)
    with pytest.raises(SamplerError, match="the replica's model has no parameter 'lm_head.extra'"):
        hf_model.load([("lm_head.extra", torch.zeros(1))])
    name, param = next(iter(hf_model.params.items()))
    with pytest.raises(SamplerError, match=rf"parameter '{name}' has shape .*, the update \(1,\)"):
        hf_model.load([(name, torch.zeros(1))])


def test_a_batch_whose_rows_all_timed_out_is_dropped_not_kept_forever(hf_model):
    sampler = HFSampler(hf_model, timeout_s=30)
    first, second = rows("lost", seed=0)[:2]
    sampler.submit(first).cancel()  # its caller gave up (the replica's row timeout); row 2 never came
    waiting = sampler.submit(second)  # one row still waited on: the batch stays
    assert list(sampler.batches) == [("lost", 3)]
    waiting.cancel()
    sampler.submit(rows("next", seed=1)[0])
    assert list(sampler.batches) == [("next", 3)]
