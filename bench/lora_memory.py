"""Memory of training steps on the bench's ~50M Llama: full fine-tuning vs LoRA (model.lora).

    python bench/lora_memory.py [--shape 2x64] [--r 8] [--target-modules q_proj,k_proj,v_proj,o_proj]

Each mode runs in a fresh process (peak RSS is per process): the engine's trainable model, then 3
SFT-loss steps on random token ids of shape rows x width. Prints one JSON line per mode and a
table: trainable parameters, Adam state, the fp32 optimizer shard a checkpoint would hold (master
weights + 2 moments of the trainable tensors), the model directory a checkpoint writes, peak RSS,
and seconds per step. Assets come from bench/bench_assets.py (built once under .bench/assets).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_assets  # noqa: E402

STEPS = 3
ROWS = ("params_trainable", "adam_state_mb", "optim_shard_mb", "model_dir_mb", "peak_rss_mb", "step_s")


def peak_rss_mb() -> float:
    """This process's own peak (VmHWM): ru_maxrss would carry over the parent's, across execve."""
    from rlflow.engine.estimate.probe import peak_resident_bytes

    return peak_resident_bytes() / 2**20


def measure(mode: str, policy: str, shape: str, lora_r: int, targets: list[str]) -> dict:
    """One mode in this process: train STEPS steps and report the figures of the module docstring."""
    from rlflow.engine.backend.runtime import LossParts, OptimSpec, Runtime
    from rlflow.engine.config.execution import EngineConfig
    from rlflow.engine.config.model import LoraConfig
    from rlflow.engine.models.lora import trainable_parameters
    from rlflow.engine.models.loading import load_policy, save_model_dir
    from rlflow.engine.stages.sft import response_token_loss

    torch.set_num_threads(2)
    lora = LoraConfig(r=lora_r, alpha=2 * lora_r, target_modules=targets) if mode == "lora" else None
    optim = OptimSpec(1e-4, 0.0, 0, 0, 1.0)
    engine = Runtime(EngineConfig()).trainable("model", lambda: load_policy(policy), optim, lora=lora)
    trainable, total = trainable_parameters(engine.model)
    rows, width = map(int, shape.split("x"))
    ids = torch.randint(3, 340, (rows, width), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.ones_like(ids), torch.ones_like(ids))
    started = time.perf_counter()
    for _ in range(STEPS):
        engine.train_step([batch], [float(rows * (width - 1))], lambda m, b: LossParts(*response_token_loss(m, *b)))
    step_s = (time.perf_counter() - started) / STEPS
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    trainable_bytes = sum(p.numel() * 4 for p in engine.model.parameters() if p.requires_grad)

    class SizeWriter:  # save_model_dir's writer interface; counts the bytes of the directory
        size = 0

        def put_dir(self, local: str, prefix: str) -> None:
            for root, _, files in os.walk(local):
                SizeWriter.size += sum(os.path.getsize(os.path.join(root, f)) for f in files)

    save_model_dir(engine.model, None, SizeWriter())
    mb = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {
        "mode": mode,
        "params_total": total,
        "params_trainable": trainable,
        "adam_state_mb": mb(sum(v.numel() * v.element_size() for v in state)),
        "optim_shard_mb": mb(3 * trainable_bytes),
        "model_dir_mb": mb(SizeWriter.size),
        "peak_rss_mb": round(peak_rss_mb()),
        "step_s": round(step_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="2x64", help="rows x tokens per step")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--mode", choices=("full", "lora"), help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    targets = args.target_modules.split(",")
    if args.mode:
        print(json.dumps(measure(args.mode, args.policy, args.shape, args.r, targets)))
        return
    policy = str(Path(bench_assets.build()["50m"]["policy"]).resolve())
    results = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--mode", mode, "--policy", policy, "--shape", args.shape, "--r", str(args.r)]
        with tempfile.TemporaryDirectory() as tmp:  # peft and HF may write caches; keep them out of the tree
            out = subprocess.run(
                cmd + ["--target-modules", args.target_modules], capture_output=True, text=True, cwd=tmp
            )
        if out.returncode:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    print(f"\n| batch {args.shape} | full fine-tune | LoRA r={args.r} on {args.target_modules} |\n|---|---|---|")
    for key in ROWS:
        print(f"| {key} | {results[0][key]:,} | {results[1][key]:,} |")


if __name__ == "__main__":
    main()
