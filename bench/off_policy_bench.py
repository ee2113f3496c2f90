"""Off-policy sampling against synchronous, side by side in one process per size and algorithm (`make bench`).

    python bench/off_policy_bench.py [--sizes tiny,50m,smollm2] [--algos ppo,grpo] [--updates N] [--out DIR]

The workloads are bench/ppo_vs_trl.py's (PPO: SIZES' batches with a critic; GRPO: GRPO_SIZES' prompts x 4,
the KL in the loss), on its assets. For each (size, algorithm) one worker process
(bench/rlflow_off_policy_worker.py) runs rlflow's RL step in eight modes one after the other: sync_colocated
(2 threads), sync_server (trainer and HF replica 2 threads each), off_policy (rollout.off_policy_steps 1, one
core each: run.threads 1, rollout.threads 1), off_policy_shared (the trainer on 2 threads), async
(rollout.async, max_staleness 1, partial rollouts, one core each), then the faster sync mode, off_policy and
async again with a slow reward (a sleeping judge, half the faster sync mode's sampling time per batch). It
prints steps/s and the phase medians per mode, the two-core bound (the sync step over half the one-core
work of both lanes: what a perfect split of off_policy's or async's work would reach), writes
bench/results/off_policy-<UTC time>.json, and last
    RESULT off_policy_vs_sync_<algo>_<size>=<off_policy steps/s over the faster sync's> ...
           off_policy_vs_sync_slow_<algo>_<size>=<the same with the slow reward> ...
           async_vs_sync_<algo>_<size>=... async_vs_sync_slow_<algo>_<size>=...
(one line; nan for what --algos or --sizes left out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

from bench_assets import build as build_assets
from grpo_bench import GRPO_SIZES, grpo_work
from harness import REPO, run_worker
from ppo_vs_trl import SIZES, WORKLOAD, machine, sig3, versions

ALGOS = ("ppo", "grpo")
MODES = ("sync_colocated", "sync_server", "off_policy", "off_policy_shared", "async", "sync_slow", "off_policy_slow",
         "async_slow")  # fmt: skip
PHASES = ("gen", "wait_rollout", "wait_train", "ref", "reward", "old_logprobs", "values", "update_actor",
          "update_critic", "update_weights", "sync_probe", "other")  # fmt: skip
UPDATES = {"tiny": 5, "50m": 3, "smollm2": 2}  # timed steps per mode (one warm-up step before them)


def work_for(size: str, algo: str, assets: dict, updates: int) -> dict:
    base = dict(WORKLOAD, warmup=1, rep=1)
    if algo == "grpo":
        return dict(grpo_work(size, assets, base, updates), rep=1)
    files = {"policy": assets[size]["policy"], "rm": assets[size]["rm"], "prompts": assets["prompts"]}
    return dict(base, size=size, algo="ppo", batch=SIZES[size]["batch"], updates=updates, **files)


def two_core_bound(run: dict, sync_step_s: float) -> float:
    """The most any schedule of this mode's work could gain over sync: the sync step over half the
    one-core seconds both lanes spent per step (the trainer's step minus its wait for samples, the
    worker's step minus its idle time). Below 1.15, no overlap reaches the goal on this machine."""
    phases = run["phases"]
    step = phases["timing_s/step"]
    busy = (step - phases.get("timing_s/wait_rollout", 0.0)) + (step - phases.get("timing_s/wait_train", 0.0))
    return sync_step_s / (busy / 2)


def summarize(result: dict) -> dict:
    runs, faster = result["runs"], result["faster_sync"]
    bounds = {
        f"{name}_two_core_bound": two_core_bound(runs[name], runs[faster]["phases"]["timing_s/step"])
        for name in ("off_policy", "async")  # with the slow judge its sleep would count as a lane's work
    }
    return bounds | {
        "faster_sync": faster,
        "steps_s": {name: runs[name]["steps_s"] for name in MODES},
        "off_policy_vs_sync": runs["off_policy"]["steps_s"] / runs[faster]["steps_s"],
        "off_policy_shared_vs_sync": runs["off_policy_shared"]["steps_s"] / runs[faster]["steps_s"],
        "off_policy_vs_sync_slow": runs["off_policy_slow"]["steps_s"] / runs["sync_slow"]["steps_s"],
        "async_vs_sync": runs["async"]["steps_s"] / runs[faster]["steps_s"],
        "async_vs_sync_slow": runs["async_slow"]["steps_s"] / runs["sync_slow"]["steps_s"],
        "judge_delay_s": runs["sync_slow"]["judge_delay_s"],
    }


def print_table(size: str, algo: str, result: dict, summary: dict) -> None:
    print(f"\n[{size} {algo}] faster sync: {summary['faster_sync']}; slow judge {summary['judge_delay_s']:.2f} s/batch")
    print(f"{'mode':<16} {'steps/s':>8} " + " ".join(f"{p:>9.9}" for p in PHASES))
    for name in MODES:
        run = result["runs"][name]
        cells = " ".join(f"{run['phases'].get(f'timing_s/{p}', 0.0):>9.3f}" for p in PHASES)
        print(f"{name:<16} {run['steps_s']:>8.3f} {cells}")
    for name in ("off_policy", "async"):
        ratio, slow = summary[f"{name}_vs_sync"], summary[f"{name}_vs_sync_slow"]
        bound = summary[f"{name}_two_core_bound"]
        print(f"{name} / faster sync: {ratio:.2f}x (its work split evenly over both cores: {bound:.2f}x);"
              f" with the slow reward: {slow:.2f}x")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,50m,smollm2")
    parser.add_argument("--algos", default="ppo,grpo")
    parser.add_argument("--updates", type=int, default=None, help="timed steps per mode (default: UPDATES)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--quiet-wait", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=1, help="accepted for `make bench ARGS=...`; one run per mode")
    args = parser.parse_args()
    args.sizes, args.algos = args.sizes.split(","), args.algos.split(",")
    if set(args.sizes) - set(SIZES) or set(args.algos) - set(ALGOS):
        parser.error(f"sizes are {', '.join(SIZES)}; algos {', '.join(ALGOS)}")
    return args


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    os.chdir(REPO)
    assets = build_assets()
    report = {"machine": machine(), "versions": versions(), "raw": {}, "summary": {}, "grpo_sizes": GRPO_SIZES}
    for size in args.sizes:
        for algo in args.algos:
            work = work_for(size, algo, assets, args.updates or UPDATES[size])
            print(f"[{size} {algo}] {len(MODES)} modes ...", flush=True)
            result = run_worker("rlflow_off_policy_worker.py", work, args.quiet_wait)
            report["raw"][f"{algo}_{size}"] = {"workload": work, "result": result}
            report["summary"][f"{algo}_{size}"] = summary = summarize(result)
            print_table(size, algo, result, summary)
    report["wall_s"] = time.monotonic() - started
    result_line = {}
    for algo in ALGOS:
        for size in SIZES:
            summary = report["summary"].get(f"{algo}_{size}", {})
            for name in ("off_policy", "async"):
                result_line[f"{name}_vs_sync_{algo}_{size}"] = summary.get(f"{name}_vs_sync")
                result_line[f"{name}_vs_sync_slow_{algo}_{size}"] = summary.get(f"{name}_vs_sync_slow")
    report["result"] = result_line
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"off_policy-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report, indent=2, default=str))
    path.with_suffix(".tmp").replace(path)
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path} ({report['wall_s']:.0f} s)")
    print("RESULT " + " ".join(f"{k}={sig3(v)}" for k, v in result_line.items()))


if __name__ == "__main__":
    main()
