"""Side-by-side timings of the engine's execution modes, measured in one run (the machine is noisy).

    python bench/engine_bench.py [--steps 6] [--out bench/results.json]

PPO: median seconds per PPO step on the demo model (64 prompts, 24 new tokens) for
  torch colocated | torch + hf rollout server | deepspeed ZeRO-2 on 1 and 2 processes | ZeRO-3 on 2.
SFT: seconds per step and bytes of activations saved for backward (one step, summed over
  micro-batches) for whole-batch, token-budget, packed, and gradient-checkpointed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import OptimSpec, Runtime
from rlflow.engine.backend.factory import make_runtime
from rlflow.engine.data.batching import encode_pair
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.data.records import load_sft_examples
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.stages.sft import sft_train_step
from rlflow.engine.stages.context import StageContext

ASSETS = Path("demo_assets")


def ppo_seconds(engine_cfg: EngineConfig, server: bool, steps: int) -> list[float]:
    """Seconds of each PPO step after the first, opened by the RL-run entry point (bench_assets.open_rl_run)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_assets import open_rl_run

    model = str(ASSETS / "tiny-model")
    tree = {
        "rl": {"rollout_batch": 64, "mini_batch": 32, "epochs": 2},
        "sampling": {"max_new_tokens": 24},
        "rollout": {"mode": "server" if server else "colocated"},
    }
    times = []
    prompts = str(ASSETS / "data/prompts.jsonl")
    with open_rl_run(tree, model, model, model, prompts, 10**9, 32, make_runtime(engine_cfg)) as run:
        if server:
            run.start_rollout()
        for step in range(1, steps + 1):
            started = time.monotonic()
            run.step(step)
            times.append(time.monotonic() - started)
    return times[1:]  # the first step pays one-time costs


def sft_figures(engine_cfg: EngineConfig, steps: int) -> dict[str, float]:
    model = str(ASSETS / "tiny-model")
    tokenizer = load_tokenizer(model)
    rows = [encode_pair(tokenizer, e.prompt, e.response, 128) for e in load_sft_examples(str(ASSETS / "data/sft.jsonl"))]
    runtime = Runtime(engine_cfg)
    engine = runtime.trainable("model", lambda: load_policy(model), OptimSpec(1e-3, 0.0, 0, 100, 1.0))
    engine.train()  # gradient checkpointing only acts in train mode
    ctx = StageContext(store=None, stage="sft", round_index=0, seed=0, identity="b", identity_tree={})  # type: ignore[arg-type]
    saved = [0]

    def pack(t: torch.Tensor):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sft_train_step(engine, runtime, rows, tokenizer.pad_token_id, 64, 1, ctx)
    times = []
    for step in range(2, steps + 2):
        started = time.monotonic()
        sft_train_step(engine, runtime, rows, tokenizer.pad_token_id, 64, step, ctx)
        times.append(time.monotonic() - started)
    return {"seconds_per_step": statistics.median(times), "saved_activation_mb": saved[0] / 2**20}


def run_launched(nproc: int, zero_stage: int, steps: int) -> list[float]:
    """A deepspeed variant under torchrun; rank 0 prints its step times as JSON."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", "29577"]
    command += [__file__, "--worker", str(zero_stage), "--steps", str(steps)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("[")][-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        times = ppo_seconds(EngineConfig(backend="deepspeed", zero_stage=args.worker), False, args.steps)
        if dist.is_main():
            print(json.dumps(times), flush=True)
        return
    torch.set_num_threads(os.cpu_count() or 2)
    ppo = {
        "torch colocated": ppo_seconds(EngineConfig(), False, args.steps),
        "torch + hf server": ppo_seconds(EngineConfig(), True, args.steps),
        "deepspeed zero2 x1": run_launched(1, 2, args.steps),
        "deepspeed zero2 x2": run_launched(2, 2, args.steps),
        "deepspeed zero3 x2": run_launched(2, 3, args.steps),
    }
    sft = {
        "whole batch": sft_figures(EngineConfig(), args.steps),
        "token budget 1024": sft_figures(EngineConfig(max_tokens_per_microbatch=1024), args.steps),
        "packed 1024": sft_figures(EngineConfig(max_tokens_per_microbatch=1024, packing=True), args.steps),
        "checkpointing": sft_figures(EngineConfig(gradient_checkpointing=True), args.steps),
    }
    base = statistics.median(ppo["torch colocated"])
    print("PPO step (64 prompts x 24 new tokens), median seconds, ratio to torch colocated:")
    for name, times in ppo.items():
        print(f"  {name:22s} {statistics.median(times):6.3f} s  x{statistics.median(times) / base:5.2f}")
    print("SFT step (64 rows), median seconds and activations saved for backward:")
    for name, figures in sft.items():
        print(f"  {name:22s} {figures['seconds_per_step']:6.3f} s  {figures['saved_activation_mb']:8.1f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps({"ppo": ppo, "sft": sft}, indent=2))


if __name__ == "__main__":
    main()
