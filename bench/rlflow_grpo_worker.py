"""One repetition of rlflow's GRPO for bench/ppo_vs_trl.py (--algos grpo), in its own process.

    python bench/rlflow_grpo_worker.py '<workload JSON>'     # normally started by bench/ppo_vs_trl.py

Loads the policy, reference and reward model through rlflow's engine (no critic: algorithm.name=grpo),
runs `warmup` GRPO steps untimed, then times `updates` steps one by one (generation of `prompts` x
`generations` samples + scoring + one optimizer step), keeping every step's timing_s/* metric. Other jobs
on the machine are handled as in the PPO worker (its Clock). Prints one line `BENCH_JSON {...}` on stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from bench_assets import emit_result, open_rl_run
from rlflow_ppo_worker import Clock, StepLog


def grpo_tree(work: dict) -> dict:
    """The run configuration: one optimizer step over the whole batch (one epoch, one mini-batch of all
    prompts), the k3 KL to the reference as a loss term, std-normalised group advantages, token-mean loss."""
    prompts, n = work["prompts_per_iter"], work["generations"]
    rl = {
        "rollout_batch": prompts,
        "mini_batch": prompts,  # counts prompts: prompts x n rows, the whole batch
        "epochs": 1,
        "actor_lr": work["lr"],
        "loss_agg": work["loss_agg"],
        "max_grad_norm": 1.0,
    }
    kl = {"in_loss": True, "estimator": work["kl_loss_type"], "loss_coef": work["beta"], "stop_above": None}
    return {
        "rl": rl,
        "kl": kl,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": work["max_new_tokens"]},
        "algorithm": {"name": "grpo", "norm_std": True},
        "rollout": {"n": n, "generate_batch": prompts * n},  # every sample in one generate call, as TRL
        "model": {"dtype": "float32"},
        "run": {"seed": work["seed"]},
    }


def setup_rlflow(work: dict) -> tuple[Callable[[int], dict[str, float]], list[list[int]], dict]:
    """rlflow's side: GRPO steps opened by the RL-run entry point (bench_assets.open_rl_run). Returns a
    function running GRPO step `step` (1-based) and returning its metrics, the prompt ids and the
    resolved config. No critic; the reward model's scores are used raw (score_norm (0, 1)), as TRL's."""
    run = open_rl_run(grpo_tree(work), work["policy"], work["rm"], None, work["prompts"], work["prompts_per_iter"],
                      work["max_prompt_tokens"])
    resolved = {k: getattr(run.inputs, k).model_dump(mode="json") for k in ("rl", "algorithm", "rollout")}
    return run.step, [list(t) for t in run.prompts.token_ids], resolved


def main() -> None:
    work = json.loads(sys.argv[1])
    torch.set_num_threads(work["threads"])
    torch.manual_seed(work["seed"])
    step, ids, config = setup_rlflow(work)
    log = StepLog(Clock(work["quiet_s"]), work)
    for index in range(1, work["warmup"] + work["updates"] + 1):
        metrics = log.run(step, index)
        if "actor/kl_loss" not in metrics or any(k.startswith("critic/v") for k in metrics):
            raise SystemExit(f"step {index}: not a critic-free step with the KL in the loss: {sorted(metrics)}")
    result = log.fields() | {
        "algo": "grpo",
        "kl_loss": [m["actor/kl_loss"] for m in log.metrics],
        "grad_norm": [m.get("actor/grad_norm") for m in log.metrics],
        "config": config,
    }
    emit_result(work, ids, result)


if __name__ == "__main__":
    main()
