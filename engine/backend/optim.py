"""The optimizer and learning-rate schedule every stage trains with (their state on disk: optim_state)."""

from __future__ import annotations

import math

import torch

FUSED_ADAM_DEVICES = ("cpu", "cuda")


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, fuse: bool = True) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step where torch has one (and `fuse`): on CPU the default
    per-tensor loop took 0.21 s per step for 50M parameters, the fused kernel 0.033 s (bench/NOTES.md).
    DeepSpeed passes fuse=False: it steps its flat partitions with the per-tensor loop."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = fuse and all(p.device.type in FUSED_ADAM_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=fused, foreach=None
    )


def adam_step_tensor(step: int, param: torch.Tensor) -> torch.Tensor:
    """Adam's step count as its state holds it: the fused kernel reads it on the parameter's device."""
    return torch.tensor(float(step), dtype=torch.float32, device=param.device)


def make_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay to 10% of the peak learning rate at total_steps
    (total_steps 0: constant after warmup, for stages that stop on a criterion, like PPO)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if total_steps <= 0:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
