"""Where the stage's replicas run and who drives them: cores for each replica and the trainer off them,
the backends' table. (The replicas themselves: test_hf_replica.py, test_vllm_replica.py; the stage
started on each: test_service.py.)"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from rlflow.engine.config.execution import RolloutConfig
from rlflow.engine.rollout.replicas import REPLICA_STARTERS, start_sampler


def test_every_server_backend_the_config_accepts_has_a_starter_and_an_unknown_one_lists_them():
    from typing import get_args

    assert set(get_args(RolloutConfig.model_fields["server_backend"].annotation)) == set(REPLICA_STARTERS)
    cfg = RolloutConfig(mode="server").model_copy(update={"server_backend": "sglang"})
    with pytest.raises(ValueError, match=r"unknown rollout.server_backend 'sglang'; use one of \['hf', 'vllm'\]"):
        start_sampler(cfg, "unused", None, None, None)


def test_the_trainer_leaves_the_replicas_cores_to_it_until_the_fleet_closes():
    """pin_trainer moves every thread of the trainer (those started before it too) off the replica's
    cores and lowers torch's thread count to the cores left; its undo restores both."""
    from rlflow.engine.rollout.replicas import pin_trainer, replica_cores

    def affinities() -> set[frozenset[int]]:
        return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    started = threading.Event()
    idle = threading.Thread(target=started.wait, daemon=True)  # a thread that exists before the pin
    idle.start()
    torch.set_num_threads(len(before))
    replica = replica_cores(1)
    restore = pin_trainer(replica)
    try:
        if len(before) == 1:  # nothing to give: the trainer keeps its only core
            assert affinities() == {frozenset(before)}
        else:
            assert affinities() == {frozenset(before - {int(replica)})}
            assert torch.get_num_threads() == len(before) - 1
    finally:
        restore()
        started.set()
    assert affinities() == {frozenset(before)} and torch.get_num_threads() == len(before)
    torch.set_num_threads(threads)
    assert pin_trainer(None)() is None  # the replica chooses its cores: nothing to pin


def test_each_replica_gets_cores_of_its_own_from_the_last_ones_and_shares_when_there_are_too_few(monkeypatch):
    from rlflow.engine.rollout.replicas import replica_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [replica_cores(2, i, 3) for i in range(3)] == ["6,7", "4,5", "2,3"]  # the trainer keeps 0 and 1
    assert replica_cores(1) == "7" and replica_cores(None) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert [replica_cores(1, i, 3) for i in range(3)] == ["1", "0", "1"]
