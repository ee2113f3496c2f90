"""A reward function that only waits: the stand-in for a remote judge or a sandbox in the off-policy
bench (bench/off_policy_bench.py). It sleeps (no CPU) and scores 0, so with weight 0 it changes
nothing but the time a step spends on its reward."""

import time


def score(prompt: str, response: str, delay_s: float = 0.0, **fields) -> float:
    time.sleep(delay_s)
    return 0.0
