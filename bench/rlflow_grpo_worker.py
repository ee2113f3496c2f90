"""One repetition of rlflow's GRPO for bench/ppo_vs_trl.py (--algos grpo), in its own process.

    python bench/rlflow_grpo_worker.py '<workload JSON>'     # normally started by bench/ppo_vs_trl.py

Loads the policy, reference and reward model through rlflow's engine (no critic: algorithm.name=grpo),
runs `warmup` GRPO steps untimed, then times `updates` steps one by one (generation of `prompts` x
`generations` samples + scoring + one optimizer step), keeping every step's timing_s/* metric. Other jobs
on the machine are handled as in the PPO worker (its Clock). Prints one line `BENCH_JSON {...}` on stdout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

from bench_assets import ids_crc
from rlflow_ppo_worker import Clock


def grpo_tree(work: dict) -> dict:
    """The run configuration: one optimizer step over the whole batch (one epoch, one mini-batch of all
    prompts), the k3 KL to the reference as a loss term, std-normalised group advantages, token-mean loss."""
    prompts, n = work["prompts_per_iter"], work["generations"]
    ppo = {
        "rollout_batch": prompts,
        "mini_batch": prompts,  # counts prompts: prompts x n rows, the whole batch
        "epochs": 1,
        "max_new_tokens": work["max_new_tokens"],
        "actor_lr": work["lr"],
        "loss_agg": work["loss_agg"],
        "stop_kl": None,
        "max_grad_norm": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    algorithm = {
        "name": "grpo",
        "norm_std": True,
        "use_kl_loss": True,
        "kl_loss_type": work["kl_loss_type"],
        "kl_loss_coef": work["beta"],
    }
    return {
        "ppo": ppo,
        "algorithm": algorithm,
        "rollout": {"n": n, "generate_batch": prompts * n},  # every sample in one generate call, as TRL
        "model": {"path": work["policy"], "dtype": "float32"},
    }


def setup_rlflow(work: dict) -> tuple[Callable[[int], dict[str, float]], list[list[int]], dict]:
    """Every call into rlflow lives here (what to adapt if its API moves). Returns a function running
    GRPO step `step` (1-based) and returning its metrics, the prompt ids and the resolved config."""
    from rlflow.engine.backend import make_runtime
    from rlflow.engine.config import EngineConfig, build_config
    from rlflow.engine.data import load_prompts
    from rlflow.engine.evaluation import encode_prompt_set
    from rlflow.engine.experience import Objective
    from rlflow.engine.ppo import make_controller, ppo_step
    from rlflow.engine.ppo_stage import PPOInputs, load_ppo_models
    from rlflow.engine.reward_source import build_reward_source

    cfg = build_config(grpo_tree(work), "bench")
    runtime = make_runtime(EngineConfig(precision="fp32"))
    policy, rm = work["policy"], work["rm"]

    def no_gold(prompt, response, **fields):
        return 0.0  # the RL step never calls the gold function (evaluation only)

    # critic=None: critic-free; the reward model's scores are used raw (score_norm (0, 1)), as TRL's.
    models = load_ppo_models(
        PPOInputs(policy, policy, policy, rm, (0.0, 1.0), None), cfg.model, cfg.ppo, no_gold, runtime
    )
    models.reward = build_reward_source(cfg.reward, models.scoring, None, None, runtime, cfg.model)
    objective = Objective.of(cfg.algorithm, cfg.rollout.n)
    records = load_prompts(work["prompts"])[: work["prompts_per_iter"]]
    prompts, _, _ = encode_prompt_set(models.tokenizer, records, work["max_prompt_tokens"], "truncate", "bench")
    controller = make_controller(cfg.ppo)  # unused with the KL in the loss; ppo_step takes one
    generate_batch = cfg.rollout.generate_batch

    def step(index: int) -> dict[str, float]:
        return ppo_step(models, controller, cfg.ppo, prompts, work["seed"], 0, index, generate_batch, objective)

    resolved = {k: getattr(cfg, k).model_dump(mode="json") for k in ("ppo", "algorithm", "rollout")}
    return step, [list(t) for t in prompts.token_ids], resolved


def main() -> None:
    work = json.loads(sys.argv[1])
    torch.set_num_threads(work["threads"])
    torch.manual_seed(work["seed"])
    step, ids, config = setup_rlflow(work)
    clock, steps, timed_steps, warmup_s = Clock(work["quiet_s"]), [], [], []
    for index in range(1, work["warmup"] + work["updates"] + 1):
        timing, metrics = clock(lambda: step(index))
        steps.append(metrics)
        # Full-length responses on both sides, or the comparison is off: the EOS is unreachable.
        if metrics.get("response_length/mean") != work["max_new_tokens"]:
            length = metrics.get("response_length/mean")
            raise SystemExit(f"step {index}: response_length/mean={length}, expected {work['max_new_tokens']}")
        if "actor/kl_loss" not in metrics or any(k.startswith("critic/v") for k in metrics):
            raise SystemExit(f"step {index}: not a critic-free step with the KL in the loss: {sorted(metrics)}")
        if index <= work["warmup"]:
            warmup_s.append(timing["seconds"])
        else:
            timed_steps.append(dict(timing, timings={k: v for k, v in metrics.items() if k.startswith("timing_s/")}))
    result = {
        "side": "rlflow",
        "algo": "grpo",
        "update_s": [s["seconds"] for s in timed_steps],
        "foreign_cores": [s["foreign_cores"] for s in timed_steps],
        "timings": [s["timings"] for s in timed_steps],
        "warmup_s": warmup_s,
        "response_length": [m["response_length/mean"] for m in steps],
        "kl_loss": [m["actor/kl_loss"] for m in steps],
        "grad_norm": [m.get("actor/grad_norm") for m in steps],
        "prompt_width": max(len(row) for row in ids),
        "prompt_ids_crc32": ids_crc(ids),
        "threads": torch.get_num_threads(),
        "config": config,
        "size": work["size"],
        "pid": os.getpid(),
    }
    print("BENCH_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
