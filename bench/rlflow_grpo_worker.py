"""One repetition of rlflow's GRPO for bench/ppo_vs_trl.py (--algos grpo), in its own process.

    python bench/rlflow_grpo_worker.py '<workload JSON>'     # normally started by bench/ppo_vs_trl.py

Loads the policy, reference and reward model through rlflow's engine (no critic: algorithm.name=grpo),
runs `warmup` GRPO steps untimed, then times `updates` steps one by one (generation of `prompts` x
`generations` samples + scoring + one optimizer step), keeping every step's timing_s/* metric. Other jobs
on the machine are handled as in the PPO worker (its Clock). Prints one line `BENCH_JSON {...}` on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable

import torch

from bench_assets import emit_result
from rlflow_ppo_worker import Clock, StepLog


def grpo_tree(work: dict) -> dict:
    """The run configuration: one optimizer step over the whole batch (one epoch, one mini-batch of all
    prompts), the k3 KL to the reference as a loss term, std-normalised group advantages, token-mean loss."""
    prompts, n = work["prompts_per_iter"], work["generations"]
    ppo = {
        "rollout_batch": prompts,
        "mini_batch": prompts,  # counts prompts: prompts x n rows, the whole batch
        "epochs": 1,
        "actor_lr": work["lr"],
        "loss_agg": work["loss_agg"],
        "max_grad_norm": 1.0,
    }
    kl = {"in_loss": True, "estimator": work["kl_loss_type"], "loss_coef": work["beta"], "stop_above": None}
    return {
        "ppo": ppo,
        "kl": kl,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": work["max_new_tokens"]},
        "algorithm": {"name": "grpo", "norm_std": True},
        "rollout": {"n": n, "generate_batch": prompts * n},  # every sample in one generate call, as TRL
        "model": {"path": work["policy"], "dtype": "float32"},
    }


def setup_rlflow(work: dict) -> tuple[Callable[[int], dict[str, float]], list[list[int]], dict]:
    """Every call into rlflow lives here (what to adapt if its API moves). Returns a function running
    GRPO step `step` (1-based) and returning its metrics, the prompt ids and the resolved config."""
    from rlflow.engine.backend.factory import make_runtime
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.config.execution import EngineConfig
    from rlflow.engine.data.records import load_prompts
    from rlflow.engine.stages.evaluation import encode_prompt_set
    from rlflow.engine.stages.rl.experience import Objective
    from rlflow.engine.stages.rl.step import make_controller, ppo_step
    from rlflow.engine.stages.rl.stage import PPOInputs, load_ppo_models
    from rlflow.engine.rewards.sources import build_reward_source

    cfg = build_config(grpo_tree(work), "bench")
    runtime = make_runtime(EngineConfig(precision="fp32"))
    policy, rm = work["policy"], work["rm"]

    def no_gold(prompt, response, **fields):
        return 0.0  # the RL step never calls the gold function (evaluation only)

    # critic=None: critic-free; the reward model's scores are used raw (score_norm (0, 1)), as TRL's.
    models = load_ppo_models(
        PPOInputs(policy, policy, policy, rm, (0.0, 1.0), None), cfg.model, cfg.ppo, no_gold, runtime
    )
    source = build_reward_source(cfg.reward, models.scoring, None, None, runtime, cfg.model)
    models = dataclasses.replace(models, reward=source)
    objective = Objective.of(cfg)
    records = load_prompts(work["prompts"])[: work["prompts_per_iter"]]
    prompts, _, _ = encode_prompt_set(models.tokenizer, records, work["max_prompt_tokens"], "truncate", "bench")
    controller = make_controller(cfg.kl)  # unused with the KL in the loss; ppo_step takes one
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
