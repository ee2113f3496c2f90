"""The reward function pool (engine/rewards/pool.py) with real worker processes: order, error
policies, timeouts, a hung or dead worker, non-blocking submit and a clean close."""

import os
import time

import pytest

from rlflow.engine.config.methods import RewardSourceConfig
from rlflow.engine.errors import ConfigError, RewardSourceError
from rlflow.engine.rewards.pool import RewardFunctionPool, SourceScores

SOURCES = [
    RewardSourceConfig(name="fn", type="function", fn="helpers.reward_fns:scripted"),
    RewardSourceConfig(name="nonempty", type="format", kwargs={"kind": "nonempty"}),
]


def batch(*behaviours):
    """Prompts p0.., responses r0.., and fields telling helpers.reward_fns.scripted what to do per sample."""
    n = len(behaviours)
    return (
        [f"p{i}" for i in range(n)],
        [f"r{i}" for i in range(n)],
        [{"behave": b, "i": i} for i, b in enumerate(behaviours)],
    )


@pytest.fixture(scope="module")
def skip_pool():
    # grace 2 s, not the default 5: the stuck-worker test waits it out; shorter would let a worker that is
    # only slow on a loaded machine (a call ending just after its 0.5 s alarm) be killed as stuck
    with RewardFunctionPool(SOURCES, workers=3, timeout_s=0.5, on_error="skip", backstop_grace_s=2.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def fail_pool():
    with RewardFunctionPool(SOURCES, workers=2, timeout_s=0.5, on_error="fail") as pool:
        yield pool


def test_scores_keep_the_batch_order_across_workers(skip_pool):
    prompts, responses, fields = batch(*["ok"] * 10)
    responses[3] = ""
    result = skip_pool.submit(prompts, responses, fields).result()
    assert result.scores == {"fn": [float(i) for i in range(10)], "nonempty": [1.0] * 3 + [0.0] + [1.0] * 6}
    assert result.skipped == {"fn": 0, "nonempty": 0} and result.errors == {}
    assert skip_pool.submit([], [], []).result() == SourceScores({"fn": [], "nonempty": []}, {"fn": 0, "nonempty": 0})


def test_a_mapping_result_gives_its_score_and_workers_have_no_torch(skip_pool):
    result = skip_pool.submit(*batch("mapping", "torch")).result()
    assert result.scores["fn"] == [0.25, 0.0]  # 0.0: torch is not in the worker's sys.modules


def test_skip_scores_failed_calls_zero_and_counts_them(skip_pool):
    prompts, responses, fields = batch("ok", "raise", "nan", "text", "ok", "sleep")
    start = time.monotonic()
    future = skip_pool.submit(prompts, responses, fields)
    assert time.monotonic() - start < 0.4  # the 0.5 s timeout is spent in a worker, not here
    result = future.result(timeout=10)
    assert time.monotonic() - start >= 0.5
    assert result.scores == {"fn": [0.0, 0.0, 0.0, 0.0, 4.0, 0.0], "nonempty": [1.0] * 6}  # the rule is unaffected
    assert result.skipped == {"fn": 4, "nonempty": 0}
    assert result.errors["fn"] == (
        "reward source 'fn' (fn helpers.reward_fns:scripted) failed on sample 1 (prompt 'p1', response 'r1'): "
        "raised ValueError: boom"
    )


@pytest.mark.parametrize(
    "behave, what",
    [
        ("raise", "raised ValueError: boom"),
        ("nan", "returned nan"),
        ("text", "returned 'high' (str), not a number"),
        ("sleep", "exceeded reward.timeout_s=0.5 s"),
    ],
)
def test_fail_raises_naming_the_source_sample_and_what_happened(fail_pool, behave, what):
    prompts, responses, fields = batch("ok", "ok", behave, "ok")
    prompts[2], responses[2] = "Q" * 100, "A" * 100
    with pytest.raises(RewardSourceError) as caught:
        fail_pool.submit(prompts, responses, fields).result(timeout=10)
    assert str(caught.value) == (
        f"reward source 'fn' (fn helpers.reward_fns:scripted) failed on sample 2 "
        f"(prompt '{'Q' * 60}', response '{'A' * 60}'): {what}"
    )
    assert fail_pool.submit(*batch("ok", "ok")).result().scores["fn"] == [0.0, 1.0]  # the pool carries on


def test_a_hung_or_dead_worker_is_restarted_and_its_samples_skipped(skip_pool):
    # 4 samples on 3 workers: slices [0, 1], [2], [3]; sample 0 blocks the timeout signal.
    result = skip_pool.submit(*batch("stuck", "ok", "exit", "ok")).result(timeout=10)
    # Calls run sample by sample, sources in order: the rule of samples 0 and 2 came after the
    # failed call and, like sample 1, never ran.
    assert result.scores == {"fn": [0.0, 0.0, 0.0, 3.0], "nonempty": [0.0, 0.0, 0.0, 1.0]}
    assert result.skipped == {"fn": 3, "nonempty": 3}
    hung = "failed on sample 0 (prompt 'p0', response 'r0'): exceeded reward.timeout_s=0.5 s and did not stop"
    assert hung in result.errors["fn"]
    assert result.errors["nonempty"].endswith("no score: its worker was killed after sample 0's source 'fn' failed")
    assert len(skip_pool.pids) == 1  # the other two were killed...
    again = skip_pool.submit(*batch("ok", "ok", "ok")).result(timeout=10)
    assert again.scores["fn"] == [0.0, 1.0, 2.0] and len(skip_pool.pids) == 3  # ...and started again


def test_a_dead_worker_is_reported_with_its_exit_code(fail_pool):
    with pytest.raises(RewardSourceError, match=r"failed on sample 0 .*: its worker process died \(exit code 3\)"):
        fail_pool.submit(*batch("exit")).result(timeout=10)


def test_close_kills_and_reaps_the_workers_and_fails_pending_batches():
    sources = [
        RewardSourceConfig(name="fn", type="function", fn="helpers.reward_fns:scripted"),
        RewardSourceConfig(name="len", type="function", fn="helpers.reward_fns:scaled_length", kwargs={"scale": 2.0}),
    ]
    pool = RewardFunctionPool(sources, workers=2, timeout_s=10.0)
    pids = pool.pids
    assert len(pids) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert pool.submit(*batch("ok", "ok")).result().scores["len"] == [4.0, 4.0]  # kwargs reach the function
    in_flight, queued = pool.submit(*batch("sleep")), pool.submit(*batch("ok"))
    time.sleep(0.1)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 2
    for future in (in_flight, queued):
        with pytest.raises(RuntimeError, match="closed before this batch was scored"):
            future.result(timeout=5)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)  # no zombies: reaped, not just killed
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(*batch("ok"))


@pytest.mark.parametrize(
    "source, message",
    [
        (
            RewardSourceConfig(name="f", type="function", fn="no_such_module:score"),
            "reward.sources[f].fn: cannot import module 'no_such_module'",
        ),
        (
            RewardSourceConfig(name="f", type="function", fn="helpers.reward_fns:missing"),
            "reward.sources[f].fn: module 'helpers.reward_fns' has no function 'missing'",
        ),
        (
            RewardSourceConfig(name="f", type="function", fn="helpers.reward_fns:answer_only", kwargs={"sacle": 2}),
            "reward.sources[f].kwargs: helpers.reward_fns:answer_only(prompt, response, answer) does not accept them",
        ),
        (
            RewardSourceConfig(name="fmt", type="regex", kwargs={"patern": "x"}),
            "reward source 'fmt' (type regex): unknown kwarg 'patern'; valid: pattern, full_match, ignore_case",
        ),
    ],
)
def test_bad_sources_fail_at_construction(source, message):
    with pytest.raises(ConfigError) as caught:
        RewardFunctionPool([source], workers=1)
    assert message in str(caught.value)
