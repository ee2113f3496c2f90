"""Everything besides weights that exact resume needs: optimizers, schedules, RNG states.

Tensors go through `torch.save` and come back only through `torch.load(weights_only=True)`, which
refuses arbitrary pickled objects; counters and controller states go into the manifest meta.
"""

from __future__ import annotations

import io
import math
import random
from typing import Any

import numpy as np
import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def make_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay to 10% of the peak learning rate at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])


def save_training_state(writer: Any, optimizers: dict[str, Any], schedulers: dict[str, Any]) -> None:
    """Write optimizer/scheduler state dicts and RNG states as `training_state.pt`."""
    state = {
        "optimizers": {k: v.state_dict() for k, v in optimizers.items()},
        "schedulers": {k: v.state_dict() for k, v in schedulers.items()},
        "rng": capture_rng(),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    writer.write_bytes("training_state.pt", buffer.getvalue())


def load_training_state(data: bytes, optimizers: dict[str, Any], schedulers: dict[str, Any]) -> None:
    state = torch.load(io.BytesIO(data), weights_only=True)
    for key, optimizer in optimizers.items():
        optimizer.load_state_dict(state["optimizers"][key])
    for key, scheduler in schedulers.items():
        scheduler.load_state_dict(state["schedulers"][key])
    restore_rng(state["rng"])


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
