"""The GRPO half of bench/ppo_vs_trl.py (--algos grpo): rlflow's GRPO against TRL 1.12's GRPOTrainer on one
identical workload, run, summarised and printed the way the PPO half is (harness.py).

Per size, B prompts x G=4 generations of 32 new tokens (always full length), temperature 1, one optimizer
step per iteration over the whole batch, the k3 KL to the reference as a loss term (beta 0.05), token-mean
loss, std-normalised group advantages, lr 1e-5, fp32, 2 threads. The batches have as many rows as the PPO
sizes' (tiny: 16 x 4 = 64, 50m and smollm2: 2 x 4 = 8), so the two comparisons sample the same tokens per iteration,
and GRPO's pairs of workers add about as much time to `make bench` as PPO's, less the critic.
"""

from __future__ import annotations

import statistics

from harness import phase_medians, print_sides, quiet_only, run_worker, side_summary

GRPO_SIZES = {
    "tiny": {"prompts": 16, "generations": 4, "updates": 6},
    "50m": {"prompts": 2, "generations": 4, "updates": 4},
    "smollm2": {"prompts": 2, "generations": 4, "updates": 3},
}
GRPO_WORKLOAD = {  # on top of the PPO workload's max_new_tokens, max_prompt_tokens, warmup, lr, seed, threads
    "beta": 0.05,  # TRL beta; rlflow kl.loss_coef
    "kl_loss_type": "k3",  # rlflow kl.estimator; TRL's KL loss is k3 (exp(ref - logp) - (ref - logp) - 1)
    "loss_agg": "token-mean",  # rlflow rl.loss_agg
    "trl_loss_type": "dapo",  # TRL's token-mean over the accumulated batch: here the step's whole batch
}
GRPO_NOTES = [
    "GRPO: the reward on the TRL side is a reward function wrapping the same reward-model folder (fp32), scoring "
    "the sampled token ids themselves (left-padded prompt ids + completion ids, one forward, the score at the "
    "last attended token), which is rlflow's reward pass token for token. TRL's own model-reward path "
    "(reward_funcs=<model>) decodes prompt and completion to text and re-tokenizes it, which with the bench "
    "tokenizer does not give back the same ids, so it would score other sequences of other widths.",
    "GRPO: neither side runs an old-log-prob pass. TRL skips it when num_iterations=1 and one generation serves "
    "one optimizer step (it takes per_token_logps.detach()); rlflow takes the update forward's own detached "
    "log-probs (single_pass_update), so the importance ratio is exactly 1 on both.",
    "GRPO: group advantages are (r - group mean) / (group std + eps), unbiased std on both; eps is 1e-4 in TRL, "
    "1e-6 in rlflow. TRL's clip range is epsilon 0.2, rlflow's rl.clip_ratio 0.2 (inactive at ratio 1).",
    "GRPO: both clip the gradient norm at 1.0 (TRL through the transformers Trainer loop) and step one fused "
    "AdamW (lr 1e-5, betas (0.9, 0.95), no weight decay, constant schedule).",
    "GRPO: TRL's loop also decodes every prompt and completion to text, logs, and repeats its per-step "
    "transformers Trainer bookkeeping inside the timed interval; that is part of its loop.",
]


def grpo_work(size: str, assets: dict, workload: dict, n_updates: int) -> dict:
    """The workload both GRPO workers of one size get (the PPO-only kl_coef left out)."""
    spec = GRPO_SIZES[size]
    base = {k: v for k, v in workload.items() if k != "kl_coef"}
    return dict(
        base,
        **GRPO_WORKLOAD,
        size=size,
        algo="grpo",
        prompts_per_iter=spec["prompts"],
        generations=spec["generations"],
        updates=n_updates,
        policy=assets[size]["policy"],
        rm=assets[size]["rm"],
        prompts=assets["prompts"],
    )


def run_grpo_size(
    size: str, assets: dict, workload: dict, reps: int, updates: int | None, quiet_s: float
) -> tuple[dict, dict, int]:
    """--reps pairs of fresh GRPO workers, alternating rlflow and TRL as the PPO pairs do."""
    n_updates = updates or GRPO_SIZES[size]["updates"]
    base = grpo_work(size, assets, workload, n_updates)
    runs: dict[str, list[dict]] = {"rlflow": [], "trl": []}
    for rep in range(1, reps + 1):
        for side, script in (("rlflow", "rlflow_grpo_worker.py"), ("trl", "trl_grpo_worker.py")):
            print(f"[{size} grpo] {side} rep {rep}/{reps} ...", flush=True)
            runs[side].append(run_worker(script, dict(base, rep=rep), quiet_s))
    return {"workload": base, "runs": runs}, summarize_grpo(size, runs, base), n_updates


def quiet_median(runs: list[dict], key: str) -> float:
    chosen, _ = quiet_only([v for run in runs for v in run[key]], [f for run in runs for f in run["foreign_cores"]])
    return statistics.median(chosen)


def summarize_grpo(size: str, runs: dict, work: dict) -> dict:
    """Per-side figures (a sample is one prompt x generation: rows = prompts x generations), their ratio,
    rlflow's phases, TRL's sampling and reward seconds, and each side's KL loss and gradient norm (the same
    objective on the same models should give alike values, though the draws differ)."""
    rows, new = work["prompts_per_iter"] * work["generations"], work["max_new_tokens"]
    crcs = {run["prompt_ids_crc32"] for side in runs.values() for run in side}
    if len(crcs) != 1:
        raise SystemExit(f"{size} grpo: the sides drew different prompt ids (crc32s {sorted(crcs)})")
    sides = {name: side_summary(side_runs, rows, new) for name, side_runs in runs.items()}
    return {
        "prompts": work["prompts_per_iter"],
        "generations": work["generations"],
        "rows": rows,
        "new_tokens": new,
        "sides": sides,
        "ratio_samples_per_s": sides["rlflow"]["samples_per_s"] / sides["trl"]["samples_per_s"],
        "rlflow_phases_median_s": phase_medians(runs["rlflow"]),
        "trl_generation_median_s": quiet_median(runs["trl"], "gen_s"),
        "trl_reward_median_s": quiet_median(runs["trl"], "reward_s"),
        "kl_loss_median": {
            "rlflow": statistics.median(v for run in runs["rlflow"] for v in run["kl_loss"]),
            "trl": statistics.median(v for run in runs["trl"] for v in run["kl"]),
        },
        "grad_norm_median": {
            name: statistics.median(v for run in side for v in run["grad_norm"] if v is not None)
            for name, side in runs.items()
        },
    }


def print_grpo_size(size: str, s: dict, reps: int, updates: int) -> None:
    head = f"{s['prompts']} prompts x {s['generations']} generations x {s['new_tokens']} new tokens"
    print(f"\n== {size} GRPO: {head}, {updates} timed iterations x {reps} reps per side ==")
    print_sides(s["sides"])
    print(f"ratio rlflow/TRL samples/s: {s['ratio_samples_per_s']:.3f}  (>1: rlflow faster)")
    phases = "  ".join(f"{k.removeprefix('timing_s/')} {v:.3f}" for k, v in s["rlflow_phases_median_s"].items())
    print(f"rlflow phases, median s: {phases}")
    print(f"TRL generation, median s: {s['trl_generation_median_s']:.3f}; reward {s['trl_reward_median_s']:.3f}")
    kl, gn = s["kl_loss_median"], s["grad_norm_median"]
    print(
        f"same objective? median KL loss rlflow {kl['rlflow']:.3g} / TRL {kl['trl']:.3g};"
        f" grad norm rlflow {gn['rlflow']:.3g} / TRL {gn['trl']:.3g}"
    )
