"""What bench/ppo_vs_trl.py's PPO and GRPO comparisons share: starting a worker in a fresh process (after
waiting for other jobs to leave the cores), and turning the workers' timings into per-side figures over
the quiet iterations.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_assets import QUIET_CORES, cpu_snapshot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRL_PATH = REPO / ".bench" / "trl"
THREADS = 2


# -- the machine -------------------------------------------------------------------------------------


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy over the next `seconds` (every process on the machine, ours included)."""
    wall0, busy0, _ = cpu_snapshot()
    time.sleep(seconds)
    wall1, busy1, _ = cpu_snapshot()
    return (busy1 - busy0) / (wall1 - wall0)


def wait_for_quiet(limit_s: float, threshold: float = 0.3) -> dict:
    """Wait (at most limit_s) until other jobs leave the cores idle: with 2 OpenMP threads on 2 cores,
    one stolen core stalls every parallel region, and one busy neighbour can slow a run several times."""
    started, seen = time.monotonic(), []
    while True:
        seen.append(round(busy_cores(), 2))
        if seen[-1] < threshold or time.monotonic() - started >= limit_s:
            return {"waited_s": round(time.monotonic() - started, 1), "busy_cores_seen": seen[-5:]}


# -- workers -----------------------------------------------------------------------------------------


def worker_env(trl: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != TRL_PATH]
    if trl:
        env["TRL_EXPERIMENTAL_SILENCE"] = "1"
        paths.insert(0, str(TRL_PATH))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_worker(script: str, work: dict, quiet_s: float) -> dict:
    quiet = wait_for_quiet(quiet_s)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(HERE / script), json.dumps(work)],
        env=worker_env(script.startswith("trl")),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{script} ({work['size']}, rep {work['rep']}) failed with exit code {proc.returncode}")
    result = json.loads(lines[-1][len("BENCH_JSON ") :])
    result.update(process_wall_s=time.monotonic() - started, quiet_wait=quiet)
    return result


# -- summaries ---------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "iqr": [q[0], q[2]]}


def quiet_only(samples: list, foreign: list[float]) -> tuple[list, bool]:
    """The samples taken while other jobs held under QUIET_CORES cores, when there are enough of them
    (two, and a third of all) to stand for the side; else all of them, flagged as contended."""
    quiet = [x for x, f in zip(samples, foreign) if f < QUIET_CORES]
    enough = len(quiet) >= max(2, len(samples) / 3)
    return (quiet, True) if enough else (list(samples), False)


def side_summary(runs: list[dict], batch: int, new_tokens: int) -> dict:
    seconds = [s for run in runs for s in run["update_s"]]
    foreign = [f for run in runs for f in run["foreign_cores"]]
    chosen, quiet = quiet_only(seconds, foreign)
    stats = spread(chosen)
    return {
        "update_s": stats,
        "samples_per_s": batch / stats["median"],
        "tokens_per_s": batch * new_tokens / stats["median"],
        "basis": f"{len(chosen)}/{len(seconds)} quiet updates" if quiet else f"all {len(seconds)} updates (contended)",
        "all_updates_s": spread(seconds),
        "rep_medians_s": [statistics.median(run["update_s"]) for run in runs],
        "foreign_cores_mean_per_rep": [statistics.fmean(run["foreign_cores"]) for run in runs],
    }


def phase_medians(runs: list[dict]) -> dict:
    steps, _ = quiet_only(
        [s for run in runs for s in run["timings"]], [f for run in runs for f in run["foreign_cores"]]
    )
    keys = sorted({k for step in steps for k in step})
    return {k: statistics.median([s[k] for s in steps if k in s]) for k in keys}


# -- output ------------------------------------------------------------------------------------------


def print_sides(sides: dict) -> None:
    """One row per side: samples/s, tokens/s, s per iteration over the chosen ones, and over all."""
    head = f"{'side':8s} {'samples/s':>10s} {'tokens/s':>10s} {'s/update median [min-max]':>28s}"
    print(f"{head}  {'measured on':28s} {'all updates: median [min-max]':30s} other jobs, cores/rep")
    for name, side in sides.items():
        u, a = side["update_s"], side["all_updates_s"]
        span = f"{u['median']:.3f} [{u['min']:.3f}-{u['max']:.3f}]"
        every = f"{a['median']:.3f} [{a['min']:.3f}-{a['max']:.3f}]"
        row = f"{name:8s} {side['samples_per_s']:10.2f} {side['tokens_per_s']:10.1f} {span:>28s}"
        others = " ".join(f"{v:.2f}" for v in side["foreign_cores_mean_per_rep"])
        print(f"{row}  {side['basis']:28s} {every:30s} {others}")
