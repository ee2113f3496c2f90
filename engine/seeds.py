"""Seeds: every process seeded alike, and the per-step seed that makes sampling and batch order
independent of restarts."""

from __future__ import annotations

import random

import numpy as np
import torch


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
