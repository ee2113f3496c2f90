"""One (size, algorithm) of bench/off_policy_bench.py, in its own process: rlflow's RL step under each
rollout mode, one after the other, each opened afresh by the RL-run entry point (bench_assets.open_rl_run).

    python bench/rlflow_off_policy_worker.py '<workload JSON>'     # normally started by off_policy_bench.py

Modes, each `warmup` untimed steps then `updates` timed ones (steps/s = updates / their wall time):
- sync_colocated: the trainer samples itself, on both cores (run.threads 2);
- sync_server: an hf rollout worker samples synchronously, trainer and worker 2 threads each (they
  take turns, so each may use both cores);
- off_policy: rollout.off_policy_steps 1, trainer and worker 1 thread each (one core each);
- off_policy_shared: the same with the trainer on 2 threads (it shares a core with the worker);
- async: rollout.async with max_staleness 1 and partial rollouts, one core each;
- sync_slow, off_policy_slow and async_slow: the faster sync mode, off_policy and async again with a reward function
  that sleeps (bench/slow_judge.py, weight 0, one pool worker): half the faster sync mode's median
  sampling time per batch, no CPU.
Every mode starts from the same policy; the workload's shapes never change (responses are always
max_new_tokens long), so the timings compare.
Prints one line `BENCH_JSON {...}`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from bench_assets import emit_result, open_rl_run
from rlflow_grpo_worker import grpo_tree
from rlflow_ppo_worker import ppo_tree

SYNC_MODES = {"sync_colocated": ("colocated", 0, 2, None), "sync_server": ("server", 0, 2, 2)}
OFF_POLICY = ("server", 1, 1, 1)  # mode, off_policy_steps, trainer threads, worker threads
OFF_POLICY_SHARED = ("server", 1, 2, 1)  # the trainer keeps both cores, the worker takes one of them
ASYNC = ("server", -1, 1, 1)  # k -1: rollout.async, max_staleness 1, partial rollouts


def mode_tree(work: dict, mode: str, k: int, worker_threads: int | None, row_delay_s: float) -> dict:
    tree = grpo_tree(work) if work["algo"] == "grpo" else ppo_tree(work)
    tree["rollout"] = tree["rollout"] | {"mode": mode, "off_policy_steps": max(k, 0), "threads": worker_threads}
    if k < 0:
        tree["rollout"] |= {"async": True, "max_staleness": 1, "partial_rollouts": True}
    sources = [{"name": "rm", "type": "model"}]
    if row_delay_s:
        judge = {"name": "judge", "type": "function", "fn": "slow_judge:score", "weight": 0.0}
        sources.append(judge | {"kwargs": {"delay_s": row_delay_s}})
    tree["reward"] = {"sources": sources, "workers": 1, "timeout_s": 60.0}
    return tree


class Bench:
    """One run of steps per mode, each on models opened afresh."""

    def __init__(self, work: dict):
        self.work = work
        self.ids: list[list[int]] = []  # the prompts' token ids (the same in every mode)

    def run(self, name: str, mode: str, k: int, threads: int, worker_threads: int | None, delay_s: float) -> dict:
        """`warmup` + `updates` steps in one mode; delay_s: the slow judge's seconds per batch."""
        work = self.work
        torch.set_num_threads(threads)
        steps = work["warmup"] + work["updates"]
        shape = mode_tree(work, mode, k, worker_threads, 0.0)
        rows = shape["rl"]["rollout_batch"] * shape["rollout"].get("n", 1)
        tree = mode_tree(work, mode, k, worker_threads, delay_s / rows)
        tree["rl"] |= {"steps": steps}  # how far the rollout worker plans ahead
        ppo = work["algo"] == "ppo"
        prompts = work["batch"] if ppo else work["prompts_per_iter"]
        walls, phases = [], []
        with open_rl_run(tree, work["policy"], work["rm"], work["rm"] if ppo else None, work["prompts"], prompts,
                         work["max_prompt_tokens"]) as run:
            self.ids = [list(t) for t in run.prompts.token_ids]
            if mode == "server":
                run.start_rollout()
            for step in range(1, steps + 1):
                started = time.monotonic()
                metrics = run.step(step)
                wall = time.monotonic() - started
                check(name, step, k, metrics, work["max_new_tokens"])
                if step > work["warmup"]:
                    walls.append(wall)
                    phases.append({key: v for key, v in metrics.items() if key.startswith("timing_s/")})
        keys = sorted({key for p in phases for key in p})
        return {
            "name": name,
            "steps_s": len(walls) / sum(walls),
            "step_wall_s": walls,
            "phases": {key: statistics.median(p.get(key, 0.0) for p in phases) for key in keys},
            "threads": [threads, worker_threads],
            "judge_delay_s": delay_s,
        }


def check(name: str, step: int, k: int, metrics: dict, new_tokens: int) -> None:
    """Stop on a step that is not the workload: short responses, or samples staler than the mode."""
    if metrics.get("response_length/mean") != new_tokens:
        raise SystemExit(f"{name} step {step}: response_length/mean={metrics.get('response_length/mean')}")
    stale, bound = metrics.get("rollout/staleness_max", 0.0), (1 if k < 0 else k)
    if (k < 0 and stale > bound) or (k >= 0 and stale != min(k, step - 1)):
        raise SystemExit(f"{name} step {step}: rollout/staleness_max={stale}, expected {min(bound, step - 1)}")


def main() -> None:
    work = json.loads(sys.argv[1])
    torch.manual_seed(work["seed"])
    bench = Bench(work)
    runs = {name: bench.run(name, *spec, 0.0) for name, spec in SYNC_MODES.items()}
    runs["off_policy"] = bench.run("off_policy", *OFF_POLICY, 0.0)
    runs["off_policy_shared"] = bench.run("off_policy_shared", *OFF_POLICY_SHARED, 0.0)
    runs["async"] = bench.run("async", *ASYNC, 0.0)
    faster = max(SYNC_MODES, key=lambda name: runs[name]["steps_s"])
    delay = 0.5 * runs[faster]["phases"]["timing_s/gen"]
    runs["sync_slow"] = bench.run("sync_slow", *SYNC_MODES[faster], delay) | {"mode": faster}
    runs["off_policy_slow"] = bench.run("off_policy_slow", *OFF_POLICY, delay)
    runs["async_slow"] = bench.run("async_slow", *ASYNC, delay)
    emit_result(work, bench.ids, {"side": "rlflow", "algo": work["algo"], "runs": runs, "faster_sync": faster})


if __name__ == "__main__":
    main()
