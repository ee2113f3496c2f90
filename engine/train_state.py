"""The optimizer, learning-rate schedule and seeds every stage trains with (state on disk: optim_state)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(*parts: int) -> int:
    """A seed derived from (run seed, round, step, ...): sampling at a step does not depend on
    how many steps ran in this process, so a resumed run draws the same tokens."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part + 0x9E3779B9 + (value << 6) + (value >> 2))) & 0xFFFFFFFFFFFFFFFF
    return value % (2**63 - 1)
