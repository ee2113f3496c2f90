"""The collectives (rlflow.engine.backend.dist) in one process: without a process group each is the
identity, and a gloo group of one rank goes through the real collectives to the same answers.
(Two and more ranks: tests/scenarios/test_backend_parity.py and test_distributed.py.)"""

import pytest
import torch
import torch.distributed as torch_dist

from rlflow.engine.backend import dist


@pytest.fixture
def no_group():
    if torch_dist.is_initialized():
        pytest.skip("a process group is already set up in this process")


@pytest.fixture
def group_of_one(no_group):
    """A real gloo process group with this process as its only rank, torn down after the test."""
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def test_one_process_is_rank_0_of_1_and_its_local_rank_comes_from_the_launcher(no_group, monkeypatch):
    assert (dist.is_distributed(), dist.rank(), dist.world_size(), dist.is_main()) == (False, 0, 1, True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert dist.local_rank() == 0
    dist.barrier()  # nothing to wait for


def test_reductions_and_gathers_of_one_process_return_its_own_values(no_group):
    total = dist.all_reduce_sum(2.5)
    assert total.dtype == torch.float64 and total.item() == 2.5
    assert dist.all_reduce_sum(torch.tensor([1, 2])).tolist() == [1.0, 2.0]
    assert dist.all_reduce_max(7) == 7
    assert dist.all_gather_json({"a": [1, "é"]}) == [{"a": [1, "é"]}]
    rows = torch.tensor([[0, 5, 6], [7, 8, 9]])
    assert torch.equal(dist.all_gather_rows(rows, pad_value=0, pad_left=True), rows)
    texts = ["a", "b", "c"]
    gathered = dist.gather_chunked_list(texts, 3, 2)
    assert gathered == texts and gathered is not texts  # a copy: the caller may change its own


def test_one_process_takes_every_chunk_and_none_is_a_filler():
    # 10 items in chunks of 3: chunks 0..3, the last holding one item
    assert dist.rank_chunks(10, 3) == [(0, True), (1, True), (2, True), (3, True)]
    assert dist.rank_chunks(9, 3) == [(0, True), (1, True), (2, True)]
    assert dist.rank_chunks(0, 4) == []
    assert dist._chunk_order(7, 3) == list(range(7))
    local = torch.arange(10).reshape(5, 2)
    assert torch.equal(dist.gather_chunked(local, 5, 2, pad_value=-1), local)


def test_a_process_group_of_one_runs_the_collectives_to_the_single_process_answers(group_of_one):
    assert dist.is_distributed() and (dist.rank(), dist.world_size()) == (0, 1)
    assert dist.all_reduce_sum(torch.tensor([1.5, 2.0])).tolist() == [1.5, 2.0]
    assert dist.all_reduce_max(-4) == -4
    # the JSON goes through a byte tensor and back: non-ASCII text and nesting survive
    assert dist.all_gather_json({"text": "naïve", "ids": [1, [2, 3]]}) == [{"text": "naïve", "ids": [1, [2, 3]]}]
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert torch.equal(dist.all_gather_rows(rows, pad_value=0.0), rows)
    assert torch.equal(dist.gather_chunked(rows, 3, 2, pad_value=0.0, pad_left=True), rows)
    assert dist.gather_chunked_list(["x", "y", "z"], 3, 2) == ["x", "y", "z"]
    assert dist.rank_chunks(5, 2) == [(0, True), (1, True), (2, True)]
    dist.barrier()
