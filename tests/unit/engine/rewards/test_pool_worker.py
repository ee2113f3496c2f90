"""The reward pool's worker side, in this process: a source's spec and effective error policy, its
scorer (rules and functions), the kwargs check, and scoring a slice through a real pipe."""

import mmap
import signal
from multiprocessing import Pipe

import pytest

from rlflow.engine.config.methods import RewardSourceConfig
from rlflow.engine.errors import ConfigError
from rlflow.engine.rewards import pool_worker
from rlflow.engine.rewards.pool_worker import CALL_COUNTER, build_scorer, check_function_kwargs, source_spec


def test_source_spec_carries_the_source_and_its_effective_error_policy():
    fn = RewardSourceConfig(name="f", type="function", fn="helpers.reward_fns:scaled_length", kwargs={"scale": 2})
    assert source_spec(fn, "fail") == {
        "name": "f",
        "type": "function",
        "fn": "helpers.reward_fns:scaled_length",
        "kwargs": {"scale": 2},
        "on_error": "fail",
    }
    own = RewardSourceConfig(name="k", type="keyword", kwargs={"keywords": ["x"]}, on_error="skip")
    assert source_spec(own, "fail")["on_error"] == "skip"


def test_a_function_scorer_passes_fields_and_the_sources_kwargs():
    spec = source_spec(
        RewardSourceConfig(name="f", type="function", fn="helpers.reward_fns:scaled_length", kwargs={"scale": 2}),
        "fail",
    )
    assert build_scorer(spec)("p", "abc", {"extra": 1}) == 6


def test_a_rule_scorer_is_built_from_its_type_and_kwargs():
    spec = source_spec(RewardSourceConfig(name="k", type="keyword", kwargs={"keywords": ["yes"]}), "fail")
    scorer = build_scorer(spec)
    assert (scorer("p", "oh YES", {}), scorer("p", "no", {})) == (1.0, 0.0)


def test_a_function_that_cannot_be_loaded_names_the_source():
    spec = {"name": "bad", "type": "function", "fn": "helpers.reward_fns:missing", "kwargs": {}, "on_error": "fail"}
    with pytest.raises(ConfigError, match=r"reward\.sources\[bad\]\.fn: .*no function 'missing'"):
        build_scorer(spec)


def test_a_kwarg_the_function_does_not_take_fails_naming_source_and_signature():
    spec = {"name": "a", "type": "function", "fn": "helpers.reward_fns:answer_only", "kwargs": {"scale": 1}}
    with pytest.raises(ConfigError, match=r"reward\.sources\[a\]\.kwargs: helpers\.reward_fns:answer_only\(prompt"):
        check_function_kwargs(spec)
    check_function_kwargs(spec | {"kwargs": {"answer": "4"}})  # a kwarg it takes passes


def _score(scorers, job, timeout_s=5.0):
    """Run one slice through a real pipe and shared counter; (outcomes, calls started)."""
    parent, child = Pipe()
    counter = mmap.mmap(-1, CALL_COUNTER.size)
    pool_worker._score_slice(child, counter, scorers, timeout_s, job)
    outcomes = []
    while parent.poll():
        outcomes.extend(parent.recv())
    return outcomes, CALL_COUNTER.unpack_from(counter)[0]


def test_a_slice_scores_each_sample_by_each_scorer_and_reports_bad_values_as_text():
    def length(prompt, response, fields):
        return len(response)

    def picky(prompt, response, fields):
        return {"nan": float("nan"), "text": "high", "map": {"other": 1}}.get(response, {"score": 0.5})

    responses = ["ok", "nan", "text", "map"]
    outcomes, started = _score([length, picky], (["p"] * 4, responses, [{}] * 4, [False, False]))
    assert started == 8
    assert outcomes == [
        2.0, 0.5,
        3.0, "returned nan",
        4.0, "returned 'high' (str), not a number",
        3.0, "returned a mapping without a 'score' key (keys: other)",
    ]  # fmt: skip


def test_a_raising_scorer_is_reported_and_stops_the_slice_under_fail():
    def boom(prompt, response, fields):
        if response == "b":
            raise ValueError("bad answer")
        return 1.0

    outcomes, started = _score([boom], (["p"] * 3, ["a", "b", "c"], [{}] * 3, [True]))
    assert outcomes == [1.0, "raised ValueError: bad answer"]
    assert started == 2  # the third sample was never started
    outcomes, _ = _score([boom], (["p"] * 3, ["a", "b", "c"], [{}] * 3, [False]))
    assert outcomes == [1.0, "raised ValueError: bad answer", 1.0]


def test_a_call_past_the_timeout_is_cut_off_by_the_alarm():
    import time

    def slow(prompt, response, fields):
        time.sleep(5)  # the 0.05 s alarm ends it

    previous = signal.signal(signal.SIGALRM, pool_worker._on_alarm)
    try:
        outcomes, _ = _score([slow], (["p"], ["r"], [{}], [False]), timeout_s=0.05)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert outcomes == ["exceeded reward.timeout_s=0.05 s"]
