"""Optimizer and RNG state on disk (rlflow.engine.backend.optim_state): shards written by owner rank
read back by any world size with identical tensors, partial reads of flattened ranges, and RNG state
through JSON."""

import json
import os
import random

import numpy as np
import torch

from rlflow.engine.backend.optim_state import (
    STATE_FILE,
    ParamState,
    ShardReader,
    capture_rng,
    owned,
    restore_rng,
    shard_bytes,
    shard_name,
    state_json,
)


def adamw_states(model: torch.nn.Module) -> dict[str, ParamState]:
    """Full AdamW state after two real steps of `model` (so both moments are non-zero)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    return {
        name: ParamState(p.detach().clone(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
        for name, p in model.named_parameters()
    }


def write_shards(step_dir: str, engine: str, states: dict[str, ParamState], world_size: int) -> None:
    """What each of `world_size` ranks writes: the parameters it owns, one shard each."""
    names = list(states)
    for rank in range(world_size):
        mine = {n: states[n] for i, n in enumerate(names) if owned(i, rank, world_size)}
        path = os.path.join(step_dir, *shard_name(engine, rank).split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(shard_bytes(mine))


def test_shard_names_and_round_robin_owners():
    assert shard_name("actor", 3) == "optim/actor.rank00003.safetensors"
    assert [i for i in range(7) if owned(i, 1, 3)] == [1, 4]
    # every parameter has exactly one writer
    assert all(sum(owned(i, r, 3) for r in range(3)) == 1 for i in range(7))


def test_adamw_state_round_trips_through_shards_of_any_world_size(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    states = adamw_states(model)
    for world_size in (1, 2, 3):  # 4 parameters over 3 ranks: rank 0 writes two of them
        step_dir = str(tmp_path / f"w{world_size}")
        write_shards(step_dir, "actor", states, world_size)
        reader = ShardReader(step_dir, "actor", world_size)
        assert reader.names() == set(states)
        for name, state in states.items():
            back = reader.get(name)
            for part in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(getattr(back, part), getattr(state, part)), (world_size, name, part)
            assert back.exp_avg_sq.abs().sum() > 0  # a real AdamW state, not zeros


def test_low_precision_masters_are_stored_as_fp32(tmp_path):
    master = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    state = ParamState(master, torch.zeros(3), torch.ones(3))
    write_shards(str(tmp_path), "critic", {"w": state}, 1)
    back = ShardReader(str(tmp_path), "critic", 1).get("w")
    assert back.master.dtype == torch.float32 and back.master.tolist() == [1.5, -2.25, 3.0]


def test_ranges_of_flattened_state_read_only_the_rows_they_need(tmp_path):
    cube = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)  # a row is 12 elements
    vector = torch.arange(5, dtype=torch.float32)
    scalar = torch.tensor(7.0)
    states = {n: ParamState(t, t * 2, t * 3) for n, t in (("cube", cube), ("vector", vector), ("scalar", scalar))}
    write_shards(str(tmp_path), "actor", states, 1)
    reader = ShardReader(str(tmp_path), "actor", 1)
    assert reader.get_range("cube", "master", 5, 20).tolist() == list(range(5, 20))  # across both rows
    assert reader.get_range("cube", "exp_avg", 13, 14).tolist() == [26.0]  # inside the second row
    assert reader.get_range("cube", "exp_avg_sq", 0, 24).tolist() == [3.0 * i for i in range(24)]
    assert reader.get_range("vector", "master", 1, 4).tolist() == [1.0, 2.0, 3.0]
    assert reader.get_range("scalar", "exp_avg", 0, 1).tolist() == [14.0]


def test_rng_state_survives_json_and_replays_the_same_draws():
    state = json.loads(json.dumps(capture_rng()))
    first = torch.rand(3).tolist()
    restore_rng(state)
    assert torch.rand(3).tolist() == first
    restore_rng({**state, "python": [3, [0] * 625, None], "numpy": ["MT19937", [0] * 624, 0, 0, 0.0]})
    assert torch.rand(3).tolist() == first  # a checkpoint from before the torch-only state


def test_the_training_state_file_holds_the_engines_counters_and_the_torch_rng():
    assert STATE_FILE == "training_state.json"
    data = json.loads(state_json({"actor": {"step": 3}}))
    assert data["engines"] == {"actor": {"step": 3}} and set(data["rng"]) == {"torch"}


def test_library_draws_from_the_global_python_and_numpy_generators_leave_the_state_file_alone():
    # Prefect's, MLflow's and botocore's retry jitter draw from these in background threads.
    before = state_json({})
    random.random(), np.random.rand()
    assert state_json({}) == before
    torch.rand(1)  # dropout's generator is part of the state
    assert state_json({}) != before
