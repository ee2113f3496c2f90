"""One ZeRO-2 training step of a tiny model on every rank (DeepSpeed, gloo on CPU).

`python -m ddp_one_step OUT_DIR` writes OUT_DIR/rank<R>.json: {rank, world_size, node_rank,
params} where params are the updated weights (flattened floats), so a test can check that all
ranks hold the same weights and that they equal one full-batch step over every rank's data.
`make_model` and `make_batch` are imported by the test for that single-process reference. On GPU
nodes (NCCL) it works too: a smoke test for a real cluster, see infra/multinode.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from rlflow.engine.backend.supervise import record_failures
from rlflow.engine.backend.supervise import line_buffered_output
from torch import nn

LR = 1e-2
MICRO_BATCH = 4  # rows per rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different rows per rank: the step only matches the reference if gradients were averaged."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(MICRO_BATCH, 8, generator=g), torch.randn(MICRO_BATCH, 1, generator=g)


def flat_params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()]).tolist()


def main(out_dir: str) -> None:
    import deepspeed

    deepspeed.init_distributed()  # gloo on CPU, NCCL on GPU; RANK/WORLD_SIZE/MASTER_* from the launcher
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # keep the torch AdamW: DeepSpeed's CPU Adam would JIT-compile
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x, y = (t.to(engine.device) for t in make_batch(rank))
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    record = {
        "rank": rank,
        "world_size": world,
        "node_rank": int(os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", "-1"))),
        "params": flat_params(engine.module),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    print(f"rank {rank}/{world} stepped, loss {loss.item():.6f}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    line_buffered_output()
    with record_failures():
        main(sys.argv[1])
