"""rlflow's PPO and GRPO against TRL 1.12's, side by side on this CPU, on identical workloads (`make bench`).

    python bench/ppo_vs_trl.py [--reps 2] [--updates N] [--sizes tiny,50m,smollm2] [--algos ppo,grpo] [--out DIR]

Per size ("tiny": the demo Llama, 64 prompts; "50m": a ~50M-parameter Llama, 8 prompts; "smollm2":
SmolLM2-135M-Instruct, 30 layers, vocab 49152, 8 prompts; 32 new tokens
each, always full length) it runs fresh worker processes, alternating rlflow and TRL for --reps
repetitions; each worker runs one untimed warm-up iteration and then times U iterations (generation +
scoring + one PPO update of actor and critic). It prints samples/s, tokens/s and seconds per iteration
per side and their ratio, rlflow's per-phase medians, the floor (the same batch's unavoidable passes
through bare torch/transformers, timed in the rlflow workers between their steps), and rlflow's training
MFU against this machine's fp32 matmul rate, measured there too; it writes every raw timing to bench/results/ppo_vs_trl-<UTC time>.json. The machine is shared:
the workers record how many cores other jobs kept busy during each update (after one they disturbed,
they wait a few seconds at most for the cores to clear), and the figures are medians over the quiet
updates (others under 0.3 cores) when there are enough of them, else over all (flagged "contended").
GRPO (grpo_bench.py: B prompts x 4 generations, tiny 16 x 4, 50m 2 x 4; one optimizer step per iteration,
KL as a loss term) runs the same way, after the PPO pairs of each size, and reports the same per-side figures
(a sample is one prompt x generation) and rlflow's phases; no floor or MFU. The last line printed is
    RESULT ppo_vs_trl=<rlflow/TRL samples/s at 50m> ppo_vs_trl_tiny=<at tiny> floor_ratio=<50m> mfu_cpu=<50m>
           grpo_vs_trl=<rlflow/TRL GRPO samples/s at 50m> grpo_vs_trl_tiny=<at tiny>
           ppo_vs_trl_smollm2=<PPO at SmolLM2> grpo_vs_trl_smollm2=<GRPO at SmolLM2>
(one line; nan for what --algos or --sizes left out).
TRL comes from .bench/trl (PYTHONPATH), never from the project's environment.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from bench_assets import build as build_assets
from grpo_bench import GRPO_NOTES, GRPO_SIZES, GRPO_WORKLOAD, print_grpo_size, run_grpo_size
from harness import REPO, THREADS, TRL_PATH, phase_medians, print_sides, quiet_only, run_worker, side_summary

SIZES = {"tiny": {"batch": 64, "updates": 6}, "50m": {"batch": 8, "updates": 4}, "smollm2": {"batch": 8, "updates": 3}}
WORKLOAD = {  # identical on both sides; see the workers for how each side is configured
    "max_new_tokens": 32,
    "max_prompt_tokens": 32,
    "warmup": 1,
    "lr": 1e-5,  # actor and critic (TRL has one optimizer over both)
    "kl_coef": 0.05,
    "seed": 0,
    "threads": THREADS,
    "quiet_s": 4.0,  # at most this long, before each timed update, waiting for other jobs to leave the cores
}
NOTES = [
    "Responses are always max_new_tokens long: the bench tokenizer's EOS (<|bench_eos|>) has id vocab_size, "
    "outside the model's logits; rlflow asserts response_length/mean == 32, TRL's worker asserts the sampled "
    "width and val/num_eos_tokens == 0.",
    "TRL's PPO loop never clips gradients (max_grad_norm is accepted and ignored); rlflow clips at 1.0.",
    "TRL trains actor and critic through one AdamW (its default: adamw_torch_fused) on pg_loss + vf_coef * "
    "vf_loss; rlflow has one torch.optim.AdamW per model. Both: lr 1e-5, betas (0.9, 0.95), no weight decay, "
    "constant schedule.",
    "TRL takes the old log-probs from generate()'s scores; rlflow recomputes them with an actor forward.",
    "TRL ends a response at its first sampled pad token (an in-range id) for its masks; shapes, and so "
    "compute, stay full width. Counted per iteration as rows_with_sampled_pad.",
    "TRL runs gc.collect() and its logging every iteration, inside the timed interval (it is part of its loop).",
    "The floor is generate + reference forward + reward forward + actor forward/backward + critic "
    "forward/backward on the batch in bare transformers, no optimizer steps: an implementation that reuses "
    "the update's forward for old log-probs and values (one epoch, one mini-batch) can approach 1. The rlflow "
    "worker times each pass (and the matmul rate) once after every timed step: this VM's speed drifts by tens "
    "of percent over minutes, so the floor and the MFU's peak are measured in the same minutes as rlflow.",
    "Figures are medians over updates during which other processes kept under 0.3 cores busy (/proc/stat "
    "minus the worker's own CPU time), when at least two and a third of them were; else over all updates.",
]
ALGOS = ("ppo", "grpo")
FLOP_FORMULA = (
    "per update, for each of actor and critic: 6 * N * T + 12 * L * H * W * T, where T = B * W tokens "
    "(W = padded prompt width + 32, the width every pass computes), N = non-embedding params + output head "
    "(vocab x hidden for the actor, hidden for the critic's score head), L layers, H hidden size (the second "
    "term: attention scores and values, forward + backward)"
)


# -- the machine -------------------------------------------------------------------------------------


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    meminfo = Path("/proc/meminfo").read_text().split()
    return {
        "cpu_model": model or platform.processor(),
        "cores": os.cpu_count(),
        "threads_used": THREADS,
        "ram_gib": round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1),
        "load_average_start": os.getloadavg(),
    }


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def versions() -> dict:
    import torch
    import transformers

    diff = git("diff", "HEAD", "--", "engine")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rlflow_git_sha": git("rev-parse", "HEAD"),
        # Another engineer edits engine/ while this runs: say which engine was measured.
        "rlflow_engine_uncommitted_changes": bool(diff),
        "rlflow_engine_diff_crc32": __import__("zlib").crc32(diff.encode()) if diff else None,
    }


def floor_figures(rlflow_runs: list[dict]) -> tuple[dict, dict, float]:
    """Median and minimum seconds of each floor pass, and the matmul rate in FLOP/s, over the rlflow
    workers' interleaved measurements (quiet ones where possible)."""
    medians, minima = {}, {}
    for name in rlflow_runs[0]["floor"]["parts"]:
        runs = [r for run in rlflow_runs for r in run["floor"]["parts"][name]]
        chosen, _ = quiet_only([r["seconds"] for r in runs], [r["foreign_cores"] for r in runs])
        medians[name], minima[name] = statistics.median(chosen), min(chosen)
    runs = [r for run in rlflow_runs for r in run["floor"]["matmul_runs"]]
    chosen, _ = quiet_only([r["seconds"] for r in runs], [r["foreign_cores"] for r in runs])
    return medians, minima, rlflow_runs[0]["matmul_flop"] / statistics.median(chosen)


def training_flops(params: dict, batch: int, width: int) -> float:
    tokens = batch * width
    attention = 12 * params["layers"] * params["hidden"] * width * tokens
    actor = 6 * (params["non_embedding"] + params["lm_head"]) * tokens + attention
    critic = 6 * (params["non_embedding"] + params["hidden"]) * tokens + attention
    return actor + critic


def mfu(rlflow_runs: list[dict], peak: float, params: dict, batch: int) -> dict:
    """rlflow's update phases (actor + critic, optimizer steps included) against the fp32 matmul rate."""
    steps, _ = quiet_only(
        [s for run in rlflow_runs for s in run["timings"]], [f for run in rlflow_runs for f in run["foreign_cores"]]
    )
    train_s = [
        s["timing_s/update_actor"] + s["timing_s/update_critic"]
        for s in steps
        if "timing_s/update_actor" in s and "timing_s/update_critic" in s
    ]
    if not train_s:
        return {"mfu_cpu": float("nan"), "why": "no timing_s/update_actor and timing_s/update_critic metrics"}
    width = rlflow_runs[0]["prompt_width"] + WORKLOAD["max_new_tokens"]
    flops = training_flops(params, batch, width)
    achieved = flops / statistics.median(train_s)
    return {
        "formula": FLOP_FORMULA,
        "flops_per_update": flops,
        "train_s_median": statistics.median(train_s),
        "achieved_flop_per_s": achieved,
        "matmul_flop_per_s": peak,
        "mfu_cpu": achieved / peak,
    }


def summarize(size: str, runs: dict, params: dict) -> dict:
    batch, new = SIZES[size]["batch"], WORKLOAD["max_new_tokens"]
    crcs = {run["prompt_ids_crc32"] for side in runs.values() for run in side}
    crcs |= {run["floor_prompt_ids_crc32"] for run in runs["rlflow"]}
    if len(crcs) != 1:
        raise SystemExit(f"{size}: the sides drew different prompt ids (crc32s {sorted(crcs)})")
    sides = {name: side_summary(side_runs, batch, new) for name, side_runs in runs.items()}
    phases = phase_medians(runs["rlflow"])
    floor_parts, floor_minima, peak = floor_figures(runs["rlflow"])
    floor_s = sum(floor_parts.values())
    trl_gen, _ = quiet_only(
        [g for run in runs["trl"] for g in run["gen_s"]], [f for run in runs["trl"] for f in run["foreign_cores"]]
    )
    return {
        "batch": batch,
        "sides": sides,
        "ratio_samples_per_s": sides["rlflow"]["samples_per_s"] / sides["trl"]["samples_per_s"],
        "rlflow_phases_median_s": phases,
        "trl_generation_median_s": statistics.median(trl_gen),
        "trl_rows_with_sampled_pad": [run["rows_with_sampled_pad"] for run in runs["trl"]],
        "floor_parts_median_s": floor_parts,
        "floor_s": floor_s,
        "floor_ratio": sides["rlflow"]["update_s"]["median"] / floor_s,
        "floor_parts_min_s": floor_minima,
        "floor_min_s": sum(floor_minima.values()),
        "floor_ratio_to_min": sides["rlflow"]["update_s"]["median"] / sum(floor_minima.values()),
        "mfu": mfu(runs["rlflow"], peak, params, batch),
    }


# -- output ------------------------------------------------------------------------------------------


def print_size(size: str, s: dict, reps: int, updates: int) -> None:
    new = WORKLOAD["max_new_tokens"]
    print(f"\n== {size}: B={s['batch']} prompts x {new} new tokens, {updates} timed updates x {reps} reps per side ==")
    print_sides(s["sides"])
    print(f"ratio rlflow/TRL samples/s: {s['ratio_samples_per_s']:.3f}  (>1: rlflow faster)")
    phases = "  ".join(f"{k.removeprefix('timing_s/')} {v:.3f}" for k, v in s["rlflow_phases_median_s"].items())
    print(f"rlflow phases, median s: {phases}")
    print(f"TRL generation, median s: {s['trl_generation_median_s']:.3f}")
    parts = "  ".join(f"{k} {v:.3f}" for k, v in s["floor_parts_median_s"].items())
    print(f"floor, median s: {parts}  = {s['floor_s']:.3f};  floor_ratio (rlflow / floor) {s['floor_ratio']:.2f}")
    print(f"floor from each part's fastest run: {s['floor_min_s']:.3f} s; rlflow / that {s['floor_ratio_to_min']:.2f}")
    m = s["mfu"]
    if "achieved_flop_per_s" in m:
        print(
            f"MFU: rlflow updates {m['flops_per_update'] / 1e9:.1f} GFLOP in {m['train_s_median']:.3f} s ="
            f" {m['achieved_flop_per_s'] / 1e9:.1f} GFLOP/s; fp32 matmul {m['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s;"
            f" mfu_cpu {m['mfu_cpu']:.3f}"
        )


def sig3(value: float | None) -> str:
    # "#" keeps trailing zeros (1.20, not 1.2): three significant digits, always.
    return "nan" if value is None or value != value else format(value, "#.3g").rstrip(".")


def write_json(out_dir: Path, report: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"ppo_vs_trl-{stamp}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(path)  # a half-written result never carries the final name
    return path


# -- main --------------------------------------------------------------------------------------------


def run_size(size: str, assets: dict, reps: int, updates: int | None, quiet_s: float) -> tuple[dict, dict, int]:
    n_updates = updates or SIZES[size]["updates"]
    base = dict(
        WORKLOAD,
        size=size,
        batch=SIZES[size]["batch"],
        updates=n_updates,
        policy=assets[size]["policy"],
        rm=assets[size]["rm"],
        prompts=assets["prompts"],
    )
    runs: dict[str, list[dict]] = {"rlflow": [], "trl": []}
    for rep in range(1, reps + 1):  # alternating, so drift in the machine's load hits both sides alike
        for side, script in (("rlflow", "rlflow_ppo_worker.py"), ("trl", "trl_ppo_worker.py")):
            print(f"[{size}] {side} rep {rep}/{reps} ...", flush=True)
            runs[side].append(run_worker(script, dict(base, rep=rep), quiet_s))
    raw = {"workload": base, "runs": runs}
    return raw, summarize(size, runs, assets[size]["params"]), n_updates


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--updates", type=int, default=None, help="timed updates per worker (default: 6 tiny, 4 50m)")
    parser.add_argument("--sizes", default="tiny,50m,smollm2")
    parser.add_argument("--algos", default="ppo,grpo", help="which comparisons to run (default: both)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--quiet-wait", type=float, default=5.0, help="max s to wait for idle cores per worker")
    args = parser.parse_args()
    args.sizes = [s for s in args.sizes.split(",") if s]
    if unknown := set(args.sizes) - set(SIZES):
        parser.error(f"unknown sizes {sorted(unknown)}; known: {', '.join(SIZES)}")
    args.algos = [a for a in args.algos.split(",") if a]
    if not args.algos or set(args.algos) - set(ALGOS):
        parser.error(f"--algos {','.join(args.algos)!r}: give one or more of {', '.join(ALGOS)}")
    return args


def run_all(args: argparse.Namespace, assets: dict, report: dict) -> None:
    """Per size: the PPO pairs, then the GRPO pairs (each alternating rlflow and TRL, fresh processes)."""
    grpo = report["grpo"]
    for size in args.sizes:
        if "ppo" in args.algos:
            raw, summary, n_updates = run_size(size, assets, args.reps, args.updates, args.quiet_wait)
            report["raw"][size], report["sizes"][size] = raw, summary
            print_size(size, summary, args.reps, n_updates)
        if "grpo" in args.algos:
            raw, summary, n_updates = run_grpo_size(size, assets, WORKLOAD, args.reps, args.updates, args.quiet_wait)
            grpo["raw"][size], grpo["sizes"][size] = raw, summary
            print_grpo_size(size, summary, args.reps, n_updates)


def main() -> None:
    args = parse_args()
    if not (TRL_PATH / "trl").is_dir():
        raise SystemExit(f"TRL is not installed in {TRL_PATH}: run `make bench` (it installs it there once)")
    started = time.monotonic()
    os.chdir(REPO)
    assets = build_assets()
    report = {"machine": machine(), "versions": versions(), "notes": NOTES, "sizes": {}, "raw": {}}
    report["grpo"] = {"notes": GRPO_NOTES, "sizes": {}, "raw": {}}
    run_all(args, assets, report)
    raws = [*report["raw"].values(), *report["grpo"]["raw"].values()]
    trl_runs = [r for raw in raws for r in raw["runs"]["trl"]]
    report["versions"]["trl"] = trl_runs[0]["trl_version"] if trl_runs else None
    report["settings"] = {
        "workload": WORKLOAD,
        "sizes": SIZES,
        "grpo_workload": GRPO_WORKLOAD,
        "grpo_sizes": GRPO_SIZES,
        "algos": args.algos,
        "reps": args.reps,
        "updates": args.updates,
    }
    report["machine"]["load_average_end"] = os.getloadavg()
    report["wall_s"] = time.monotonic() - started
    get = lambda size, *keys: _dig(report["sizes"].get(size), keys)  # noqa: E731
    get_grpo = lambda size: _dig(report["grpo"]["sizes"].get(size), ("ratio_samples_per_s",))  # noqa: E731
    report["result"] = {  # the PPO keys first and unchanged: scripts read this line
        "ppo_vs_trl": get("50m", "ratio_samples_per_s"),
        "ppo_vs_trl_tiny": get("tiny", "ratio_samples_per_s"),
        "floor_ratio": get("50m", "floor_ratio"),
        "mfu_cpu": get("50m", "mfu", "mfu_cpu"),
        "grpo_vs_trl": get_grpo("50m"),
        "grpo_vs_trl_tiny": get_grpo("tiny"),
        "ppo_vs_trl_smollm2": get("smollm2", "ratio_samples_per_s"),
        "grpo_vs_trl_smollm2": get_grpo("smollm2"),
    }
    path = write_json(Path(args.out), report)
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path} ({report['wall_s']:.0f} s)")
    print("RESULT " + " ".join(f"{k}={sig3(v)}" for k, v in report["result"].items()))


def _dig(tree: dict | None, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


if __name__ == "__main__":
    main()
