"""Peak memory at a real vocabulary (SmolLM2-135M, V = 49152, fp32, full fine-tuning), with the
LM head in chunks (engine/models/lm_head.py) and with full-width logits, each case in a fresh process.

    .venv/bin/python bench/real_memory.py --model models/smollm2-135m-instruct [--cases sft grpo ppo]
        [--engine gradient_checkpointing=true --engine micro_batch_size=8]

Cases: `sft` one SFT-loss step on 64 x 128 random tokens; `grpo` one GRPO step of 8 prompts x 4
samples x 32 new tokens (chain_sum prompts, the gym verifier as reward, KL loss to a reference);
`ppo` one PPO step of 32 prompts x 32 new tokens with a critic started from the policy. Prints a
JSON line per run and a table of peak RSS (MB) and seconds, chunked vs whole. `--engine k=v` sets
engine.* keys (both sides): what a step's peak costs with micro-batches or gradient checkpointing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch
import yaml

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def peak_rss_mb() -> float:
    """This process's own peak (VmHWM): ru_maxrss would carry over the parent's, across execve."""
    from rlflow.engine.estimate.probe import peak_resident_bytes

    return peak_resident_bytes() / 2**20


def sft_step(model_dir: str, engine_keys: dict) -> None:
    from rlflow.engine.backend.runtime import LossParts, OptimSpec, Runtime
    from rlflow.engine.config.execution import EngineConfig
    from rlflow.engine.models.loading import load_policy
    from rlflow.engine.stages.sft import response_token_loss

    runtime = Runtime(EngineConfig(**engine_keys))
    engine = runtime.trainable("model", lambda: load_policy(model_dir), OptimSpec(1e-6, 0, 0, 0, 1.0))
    ids = torch.randint(3, 49152, (64, 128), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.ones_like(ids), torch.ones_like(ids))
    engine.train_step([batch], [float(64 * 127)], lambda m, b: LossParts(*response_token_loss(m, *b)))


def rl_step(model_dir: str, algorithm: str, engine_keys: dict) -> dict:
    """One RL step of `algorithm` on reasoning-gym's chain_sum, opened by the RL-run entry point."""
    from rlflow.engine.backend.factory import make_runtime
    from rlflow.engine.config.execution import EngineConfig
    from rlflow.engine.tasksets.gym import write_gym_dataset

    from bench_assets import open_rl_run

    prompts_n, n = (8, 4) if algorithm == "grpo" else (32, 1)
    tree = {
        "algorithm": {"name": algorithm},
        "rollout": {"n": n, "generate_batch": prompts_n * n},
        "rl": {"rollout_batch": prompts_n, "mini_batch": prompts_n, "epochs": 1, "actor_lr": 1e-6},
        "ppo": {"critic_init": "policy"},
        "kl": {"stop_above": None},
        "sampling": {"max_new_tokens": 32},
        "reward": {"sources": [{"name": "correct", "type": "gym", "kwargs": {"extract": "last_number"}}]},
    }
    runtime = make_runtime(EngineConfig(**({"precision": "fp32"} | engine_keys)))
    critic = model_dir if algorithm == "ppo" else None
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_gym_dataset("chain_sum", tmp, prompts_n, 1, 0, CHAIN, "last_number")["paths"]["prompts"]
        with open_rl_run(tree, model_dir, None, critic, prompts, prompts_n, 96, runtime) as run:
            return run.step(1)


def run_case(case: str, model_dir: str, chunked: bool, engine_keys: dict) -> dict:
    from rlflow.engine.models import lm_head

    torch.set_num_threads(2)
    lm_head.CHUNK_TOKENS = lm_head.CHUNK_TOKENS if chunked else None
    baseline = peak_rss_mb()
    started = time.perf_counter()
    metrics = sft_step(model_dir, engine_keys) if case == "sft" else rl_step(model_dir, case, engine_keys)
    return {
        "case": case,
        "chunked": chunked,
        "engine": engine_keys,
        "peak_rss_mb": round(peak_rss_mb()),
        "rss_before_mb": round(baseline),
        "seconds": round(time.perf_counter() - started, 1),
        "response_length": None if metrics is None else metrics.get("response_length/mean"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--cases", nargs="*", default=["sft", "grpo", "ppo"], choices=["sft", "grpo", "ppo"])
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="an engine.* key")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "CHUNKED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    engine_keys = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.engine)}
    if args.worker:
        row = run_case(args.worker[0], args.model, args.worker[1] == "1", engine_keys)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    rows = []
    for case in args.cases:
        for chunked in (True, False):
            cmd = [sys.executable, __file__, "--model", args.model, "--worker", case, str(int(chunked))]
            cmd += [f"--engine={item}" for item in args.engine]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'case':6} {'chunked MB':>11} {'whole MB':>9} {'saved MB':>9} {'chunked s':>10} {'whole s':>8}")
    for case in args.cases:
        a, b = (next(r for r in rows if r["case"] == case and r["chunked"] is c) for c in (True, False))
        saved = b["peak_rss_mb"] - a["peak_rss_mb"]
        print(f"{case:6} {a['peak_rss_mb']:>11} {b['peak_rss_mb']:>9} {saved:>9} {a['seconds']:>10} {b['seconds']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
