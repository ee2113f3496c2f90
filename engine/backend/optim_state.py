"""Optimizer and RNG state on disk, world-size independent and never pickled.

Each trainable model's AdamW state is stored per parameter *name* as full (unpartitioned) fp32
tensors — master weight, first and second moment — in safetensors shards, one per rank
(parameter i is written by rank i % world_size), plus counters in JSON. Any world size reads any
other's shards: a rank looks up every parameter by name and keeps its own partition, which is how
2 -> 1 and 1 -> 2 process resumes work without DeepSpeed's pickled checkpoints.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

STATE_FILE = "training_state.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ParamState:
    """Full fp32 AdamW state of one parameter (each tensor has the parameter's shape)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def shard_name(engine: str, rank: int) -> str:
    return f"optim/{engine}.rank{rank:05d}.safetensors"


def owned(index: int, rank: int, world_size: int) -> bool:
    """Whether `rank` writes parameter number `index` (round-robin spreads the bytes evenly)."""
    return index % world_size == rank


def shard_bytes(states: dict[str, ParamState]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for name, state in states.items():
        tensors[f"{name}::master"] = state.master.detach().float().cpu().contiguous()
        tensors[f"{name}::exp_avg"] = state.exp_avg.detach().float().cpu().contiguous()
        tensors[f"{name}::exp_avg_sq"] = state.exp_avg_sq.detach().float().cpu().contiguous()
    return safetensors_bytes(tensors)


class ShardReader:
    """Look up any parameter's state across all shards of one engine in a local step directory."""

    def __init__(self, step_dir: str, engine: str, world_size: int):
        self._files = [os.path.join(step_dir, *shard_name(engine, r).split("/")) for r in range(world_size)]
        self._where: dict[str, str] = {}
        for path in self._files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    self._where[key.rsplit("::", 1)[0]] = path

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> ParamState:
        with safe_open(self._where[name], framework="pt") as f:
            return ParamState(*(f.get_tensor(f"{name}::{part}") for part in ("master", *MOMENTS)))

    def get_range(self, name: str, part: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of one state tensor ("master", "exp_avg", "exp_avg_sq") in
        flattened order, as a 1-D fp32 tensor. Only the rows holding them are read, so a ZeRO rank
        restoring its partition reads about 1/world_size of the bytes."""
        with safe_open(self._where[name], framework="pt") as f:
            view = f.get_slice(f"{name}::{part}")
            shape = view.get_shape()
            if len(shape) < 2:
                return f.get_tensor(f"{name}::{part}").flatten()[start:end] if not shape else view[start:end]
            row = math.prod(shape[1:])
            first, last = start // row, -(-end // row)
            return view[first:last].flatten()[start - first * row : end - first * row]


def capture_rng() -> dict[str, Any]:
    """The torch generator only: dropout (LoRA's, the model's) draws from it. Python's and NumPy's
    global generators are left out on purpose: nothing in training draws from them (every engine draw
    uses a generator seeded by `step_seed`), and library threads in the same process do (HTTP retry
    jitter in Prefect, MLflow, botocore, websockets), so their state at a step is not a function of
    training, and saving it made a resumed checkpoint differ from the uninterrupted one."""
    return {"torch": torch.get_rng_state().tolist()}


def restore_rng(state: dict[str, Any]) -> None:
    """Checkpoints written before the torch-only state also hold "python" and "numpy"; they are ignored."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def state_json(engines: dict[str, dict[str, Any]]) -> bytes:
    return json.dumps({"engines": engines, "rng": capture_rng()}, sort_keys=True).encode()
