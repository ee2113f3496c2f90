"""A stage's identity (the hash of its inputs record) and software versions travel with its
checkpoints; continuing under a changed identity is refused unless resume.allow_config_change is
set, which continues and reports the changed keys; a stage written by rlflow 0.1 is refused either way."""

import os
import zlib

import pytest
import torch

from conftest import RecordingSink, small_config_tree
from helpers.stage_ctx import make_call, model
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import CheckpointError
from rlflow.engine.stages.catalog import run_stage
from rlflow.engine.stages.identity import IDENTITY_FORMAT, identity_of
from rlflow.engine.stages.lifecycle import set_threads
from rlflow.engine.stages.sft import SFTUpstream
from rlflow.engine.stages.worker import call_inputs, make_context
from rlflow.engine.storage.checkpoint import CheckpointStore


def setup(assets, root, lr=2e-3, allow=False):
    tree = small_config_tree(
        assets,
        root,
        sft={"max_steps": 6, "eval_every": 3, "batch_size": 16, "warmup_steps": 1, "log_every": 1, "lr": lr},
        checkpoint={"every_steps": 2, "keep_last": 5},
        resume={"allow_config_change": allow},
    )
    config = build_config(tree, "test")
    identity_tree = {"format": IDENTITY_FORMAT, "sft": config.sft.model_dump(mode="json")}
    upstream = SFTUpstream(init=model(assets / "tiny-model"))
    call = make_call(root, "sft", upstream, identity_of(identity_tree), identity_tree)
    return config, call


def run(config, call, sink=None):
    return run_stage(make_context(config, call, sink or RecordingSink()), call_inputs(config, call))


def test_a_changed_identity_is_refused_unless_allowed_then_continues_and_reports_the_keys(small_assets, tmp_path):
    config, call = setup(small_assets, tmp_path)
    run(config, call)
    store = CheckpointStore(call.store_url)
    meta = store.manifest(6)["meta"]
    assert meta["identity_tree"] == call.identity_tree and meta["versions"]["torch"] == torch.__version__
    # As if killed after committing step 4.
    os.remove(tmp_path / "sft" / "final.json")
    store.delete_step(6)

    changed_config, changed_call = setup(small_assets, tmp_path, lr=1e-3)
    refused = r"interrupted at step 4 under a different configuration .*changed: sft.lr"
    with pytest.raises(CheckpointError, match=refused):
        run(changed_config, changed_call)
    assert store.committed_steps() == [2, 4] and store.final() is None  # nothing touched

    allowed_config, allowed_call = setup(small_assets, tmp_path, lr=1e-3, allow=True)
    sink = RecordingSink()
    outcome = run(allowed_config, allowed_call, sink)
    assert outcome.resumed_from == 4 and outcome.step == 6 and outcome.changed_keys == ("sft.lr",)
    assert [s for s, _ in sink.series("sft/loss")] == [5, 6]
    assert store.manifest(6)["meta"]["identity_tree"] == allowed_call.identity_tree

    # Finished: the original config is now the changed one; refused, then kept when allowed.
    original_config, original_call = setup(small_assets, tmp_path)
    with pytest.raises(CheckpointError, match=r"already finished with a different configuration .*sft.lr"):
        run(original_config, original_call)
    kept = run(setup(small_assets, tmp_path, allow=True)[0], original_call)
    assert kept.skipped and kept.changed_keys == ("sft.lr",) and kept.manifest_sha256 == outcome.manifest_sha256


def test_resume_verifies_the_step_and_refuses_a_damaged_file_without_touching_anything(small_assets, tmp_path):
    config, call = setup(small_assets, tmp_path)
    run(config, call)
    os.remove(tmp_path / "sft" / "final.json")  # as if killed after committing step 6
    shard = tmp_path / "sft" / "step_000006" / "optim" / "model.rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle of Adam's state
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_000006/optim/model.rank00000.safetensors is corrupted.*delete"):
        run(config, call)
    assert shard.read_bytes() == bytes(data) and CheckpointStore(call.store_url).committed_steps() == [2, 4, 6]


def test_a_stage_written_by_rlflow_0_1_is_refused_even_when_config_changes_are_allowed(small_assets, tmp_path):
    config, call = setup(small_assets, tmp_path)
    tree_0_1 = {"stage": "sft", "seed": 0, "config": {"sft": {}}, "inputs": {"init": "x"}, "data": {}}  # no format
    run(config, call.model_copy(update={"identity": "old", "identity_tree": tree_0_1}))  # as rlflow 0.1 wrote it
    store = CheckpointStore(call.store_url)
    for allowed in (False, True):
        current_config = setup(small_assets, tmp_path, allow=allowed)[0]
        with pytest.raises(CheckpointError, match=r"written by rlflow 0.1.* new run.name"):
            run(current_config, call)
    # An interrupted one too: as if killed after committing step 4.
    os.remove(tmp_path / "sft" / "final.json")
    store.delete_step(6)
    with pytest.raises(CheckpointError, match=r"written by rlflow 0.1"):
        run(setup(small_assets, tmp_path, allow=True)[0], call)
    assert store.committed_steps() == [2, 4] and store.manifest(4)["meta"]["identity_tree"] == tree_0_1


def test_threads_come_from_omp_num_threads_when_it_is_set_and_from_the_config_otherwise(monkeypatch):
    saved = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        set_threads(3)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what a launcher packing ranks onto cores sets
        set_threads(3)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def test_a_stage_is_seeded_from_its_name_and_the_rl_stage_keeps_the_seed_it_had_as_ppo(tmp_path):
    """LoRA draws its adapters from the stage's random state: the rename of ppo to rl must not change
    which adapters a config starts from (bench/summaries.py's lora-s0 pipeline did, before this)."""
    from helpers.stage_ctx import make_ctx
    from rlflow.engine.seeds import seed_everything, step_seed
    from rlflow.engine.stages.lifecycle import start_stage

    def drawn_after_start(stage):
        assert start_stage(make_ctx(tmp_path / stage, stage)) == (None, ())
        return torch.rand(4)

    def drawn_after_seed(name):
        seed_everything(step_seed(0, 0, zlib.crc32(name.encode())))
        return torch.rand(4)

    assert torch.equal(drawn_after_start("rl"), drawn_after_seed("ppo"))
    assert torch.equal(drawn_after_start("sft"), drawn_after_seed("sft"))
    assert not torch.equal(drawn_after_seed("rl"), drawn_after_seed("ppo"))
