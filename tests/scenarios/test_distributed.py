"""Training stages launched as DeepSpeed jobs the way the Prefect task does it: rank 0's metric
events reach the task's sink, a killed rank fails the task naming it, and a stage
checkpointed by N processes resumes on M processes (2 -> 1 and 1 -> 2) to the same weights as an
uninterrupted single-process run."""

import json
import logging
import os
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import run_call
from helpers.stage_ctx import sft_call as sft_call_of
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import ResourcesConfig
from rlflow.engine.backend.launch import DistributedJobError, build_launch_command, free_port, rank_env
from rlflow.engine.backend.supervise import run_distributed
from rlflow.engine.telemetry.metrics import EVENT_PREFIX
from rlflow.engine.stages.worker import StageCall, write_spec
from rlflow.tasks.distributed import WORKER_MODULE, launch_training_stage

TOLERANCE = 1e-5
STEPS = 6


@pytest.fixture(autouse=True)
def _extensions(monkeypatch):
    # The DeepSpeed op compiled by `make install` (the Makefile exports the same folder).
    monkeypatch.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    )


def sft_config(assets, root, nproc: int, backend: str = "deepspeed", zero_stage: int = 2):
    tree = small_config_tree(
        assets,
        root,
        sft={"max_steps": STEPS, "eval_every": 3, "batch_size": 16, "warmup_steps": 1, "log_every": 1},
        # Only the last checkpoint holds a whole model: resuming from step 2 or 4 must rebuild
        # the weights from the optimizer shards' fp32 masters.
        checkpoint={"every_steps": 2, "keep_last": 3, "consolidate_every": 100},
        engine={"backend": backend, "zero_stage": zero_stage, "max_tokens_per_microbatch": 200},
        resources={"nproc_per_node": nproc},
        rollout={"generate_batch": 8},  # every rank needs rollout and evaluation chunks of its own
        eval={"batch_size": 16},
    )
    return build_config(tree, "test")


def sft_call(root, assets) -> StageCall:
    return sft_call_of(root, assets / "tiny-model")


def final_weights(outcome) -> dict:
    return load_file(f"{outcome.checkpoint_uri}/model/model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(small_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("torch")
    config = sft_config(small_assets, root, 1, backend="torch")
    call = sft_call(root, small_assets)
    return final_weights(run_call(config, call))


# Each rank restores only what it keeps: ZeRO-2 its fragment of the state, ZeRO-3 its slice of
# weight and state (1 -> 2: rank 1 reads the second half of every flattened tensor).
@pytest.mark.parametrize("first,second,zero", [(2, 1, 2), (1, 2, 2), (1, 2, 3)])
def test_resume_on_a_different_world_size(small_assets, tmp_path, monkeypatch, uninterrupted, first, second, zero):
    call, logger = sft_call(tmp_path, small_assets), logging.getLogger("test")
    monkeypatch.setenv("RLFLOW_FAULT", "sft:ckpt_manifest:4")  # rank 0 dies right after committing step 4
    sink = RecordingSink()
    with pytest.raises(DistributedJobError, match=r"rank 0 exited with code 137 \(died without a Python exception"):
        launch_training_stage(sft_config(small_assets, tmp_path, first, zero_stage=zero), call, sink, logger)
    assert [s for s, _ in sink.series("sft/loss")] == [1, 2, 3, 4]  # rank 0's events, replayed before it died
    store = CheckpointStore(f"{tmp_path}/sft")
    assert store.committed_steps()[-1] == 4 and store.final() is None
    assert store.manifest(4)["meta"]["consolidated"] is False  # weights live only in the shards
    assert sum(n.startswith("optim/model.rank") for n in store.manifest(4)["files"]) == first

    monkeypatch.delenv("RLFLOW_FAULT")
    sink = RecordingSink()
    outcome = launch_training_stage(sft_config(small_assets, tmp_path, second, zero_stage=zero), call, sink, logger)
    assert outcome.resumed_from == 4 and outcome.step == STEPS
    assert [s for s, _ in sink.series("sft/loss")] == [5, 6]  # replayed from rank 0's event lines
    weights = final_weights(outcome)
    worst = max((weights[k] - v).abs().max().item() for k, v in uninterrupted.items())
    assert worst <= TOLERANCE, f"resumed {first}->{second} differs from the uninterrupted run by {worst:.2e}"


def test_two_nodes_one_process_each_run_the_stage_worker(small_assets, tmp_path):
    """The task's launch on 2 nodes x 1 process, both on 127.0.0.1: each node starts its own
    torchrun (node_rank 0 and 1, same master port) of the stage worker; together they run SFT
    steps as one world of 2 and commit a checkpoint with one optimizer shard per rank."""
    port = free_port()
    config = sft_config(small_assets, tmp_path, 1).model_copy(
        update={"resources": ResourcesConfig(nnodes=2, nproc_per_node=1, master_port=port)}
    )
    config = config.model_copy(update={"sft": config.sft.model_copy(update={"max_steps": 2})})
    call = sft_call(tmp_path, small_assets)
    spec, outcome_path = str(tmp_path / "spec.json"), tmp_path / "outcome.json"
    write_spec(spec, config.model_dump(mode="json"), call, str(outcome_path))
    lines: dict[int, list] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}

    def node(node_rank: int) -> None:
        resources = config.resources.model_copy(update={"node_rank": node_rank})
        command = build_launch_command(
            resources, WORKER_MODULE, [spec], port, log_dir=str(tmp_path / f"logs{node_rank}")
        )
        env = rank_env(dict(os.environ), 1, os.cpu_count() or 1)
        try:
            run_distributed(command, env, lambda rank, text: lines[node_rank].append((rank, text)), timeout_s=240)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors[node_rank] = exc

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == {}, errors
    outcome = json.loads(outcome_path.read_text())  # written by rank 0 (node 0)
    assert outcome["step"] == 2
    files = CheckpointStore(f"{tmp_path}/sft").manifest(2)["files"]
    assert sorted(n for n in files if n.startswith("optim/")) == [
        "optim/model.rank00000.safetensors",
        "optim/model.rank00001.safetensors",
    ]
    assert any(r == 0 and t.startswith(EVENT_PREFIX) for r, t in lines[0])  # rank 0 reports metrics
    assert all(r == 1 for r, _ in lines[1] if r is not None)  # node 1's process is global rank 1


def test_secret_values_are_found_at_any_depth():
    from rlflow.tasks.distributed import secret_values

    tree = {"run": {"storage_options": {"key": "AKIA-EXAMPLE", "client_kwargs": {"token": ["tok-123456"]}, "n": 1}}}
    values = secret_values(tree)
    assert {"AKIA-EXAMPLE", "tok-123456"} <= set(values) and "1" not in values
    assert values[0] == __import__("json").dumps(tree)  # the whole JSON first (longest)


def test_multi_node_jobs_exchange_spec_and_outcome_under_run_root(small_assets, tmp_path):
    """Other nodes cannot see this machine's temp dir: a multi-node job's spec (and rank 0's
    outcome, rank 0 may sit on another host) go under run.root, removed after the job."""
    from rlflow.tasks.distributed import _exchange

    one_node = sft_config(small_assets, tmp_path, 1)
    with _exchange(one_node, sft_call(tmp_path, small_assets), str(tmp_path / "local")) as base:
        assert base == str(tmp_path / "local")
    two_nodes = one_node.model_copy(update={"resources": ResourcesConfig(nnodes=2, master_port=29500)})
    with _exchange(two_nodes, sft_call(tmp_path, small_assets), str(tmp_path / "local")) as base:
        assert base.startswith(f"{tmp_path}/t/.launch/round_0-sft-")
        write_spec(f"{base}/spec.json", {}, sft_call(tmp_path, small_assets), f"{base}/outcome.json")
        assert Path(base, "spec.json").is_file()
    assert not Path(base).exists()


def test_a_non_finite_loss_under_deepspeed_stops_the_stage_before_a_commit_and_is_not_retried(
    small_assets, tmp_path, monkeypatch
):
    from rlflow.tasks.stages import retryable

    call, sink = sft_call(tmp_path, small_assets), RecordingSink()
    monkeypatch.setenv("RLFLOW_FAULT", "sft:nonfinite:3")
    with pytest.raises(DistributedJobError, match="non-finite loss under DeepSpeed") as raised:
        launch_training_stage(sft_config(small_assets, tmp_path, 1), call, sink, logging.getLogger("test"))
    assert raised.value.exit_code == 2  # the worker's code for "a rerun would fail the same way"

    class State:  # what Prefect hands its retry condition
        def result(self, raise_on_failure):
            return raised.value

    assert retryable(None, None, State()) is False
    store = CheckpointStore(f"{tmp_path}/sft")
    assert store.committed_steps() == [2] and store.final() is None  # nothing after the NaN was committed
    store.verify(2)
