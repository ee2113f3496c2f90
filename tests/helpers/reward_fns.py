"""Reward functions named in configs by reference ("helpers.reward_fns:scripted"), imported in the
reward pool's worker processes (tests/unit/engine/rewards/test_pool.py, the RL stage's tests) and
in the test process: pytest's pythonpath (pyproject.toml) puts tests/ on sys.path, and each pool
worker gets the parent's sys.path."""

import os
import signal
import sys
import time


def scripted(prompt, response, behave="ok", i=0, **fields):
    """Does what the sample's `behave` column says; "ok" scores the sample's `i` column."""
    if behave == "raise":
        raise ValueError("boom")
    if behave == "nan":
        return float("nan")
    if behave == "text":
        return "high"
    if behave == "mapping":
        return {"score": 0.25, "length": len(response)}
    if behave == "sleep":
        time.sleep(5)
    if behave == "stuck":  # a call the timeout signal cannot stop (as if stuck in C code)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(30)
    if behave == "exit":
        os._exit(3)
    if behave == "torch":
        return float("torch" in sys.modules)
    return float(i)


def scaled_length(prompt, response, *, scale, **fields):
    """`scale` comes from the source's kwargs: scale x characters of the response."""
    return scale * len(response)


def answer_only(prompt, response, answer):
    """Takes no **fields: a kwarg of its source it does not take fails when the pool is built."""
    return float(response == answer)


def constant_rule(prompt, response, **fields):
    """Scores every answer alike: a fallback rule whose scores have no spread (test_breaker.py)."""
    return {"score": 0.5}


def valid_until_marker(prompt, response, marker="", **fields):
    """A 'valid rule' that holds until the file `marker` exists (a test's sink creates it at a chosen
    step): every answer valid before, none after, a scripted collapse of the valid share."""
    return 0.0 if os.path.exists(marker) else 1.0


def prefer_longer(prompt, a, b, rng, **fields):
    """A labeller: the longer answer; a tie when both are as long."""
    return None if len(a) == len(b) else 0 if len(a) > len(b) else 1


def response_length(prompt, response, **fields):
    """A gold score: the answer's length in characters."""
    return float(len(response))


def never_called(prompt, response, **fields):
    """A gold score that must not be called (RL steps never evaluate)."""
    raise AssertionError("the gold function must not be called by an RL step")


def zero(prompt, response, **fields):
    return 0.0


def longer_noting_rows(prompt, a, b, rng, log, **fields):
    """A labeller that prefers the longer answer (a tie when equal) and appends each call's prompt and
    row `answer` to the JSONL file `log`."""
    import json

    with open(log, "a") as f:
        f.write(json.dumps({"prompt": prompt, "answer": fields["answer"]}) + "\n")
    return None if a == b else 0 if len(a) >= len(b) else 1
