"""rollout.off_policy_steps = k: the worker process samples ahead of training, and the run still
resumes exactly.

For k = 1 and 2, PPO (with its critic) runs as `python -m rlflow.engine.stages.worker` subprocesses
with an `hf` rollout replica: one uninterrupted reference, then a chain of runs each killed at the
next point (the trainer by RLFLOW_FAULT at a PPO kill point, the rollout replica at its n-th
generate request), then one that finishes. The final checkpoint must be byte-identical to the
reference's and every logged metric equal to the reference's at that step: the batches sampled
ahead are restored from the checkpoint, not sampled again by newer weights.
"""

import json
from pathlib import Path

import pytest

from conftest import small_config_tree
from helpers.stage_ctx import rl_call
from helpers.stage_worker import final_files, finish_worker, stable, start_worker
from rlflow.engine.faults import KILLED_EXIT_CODE
from rlflow.engine.storage.checkpoint import CheckpointStore

STEPS = 5

# Checkpoints at 2, 4 and 5; each run dies at the next fault of its chain, the last one finishes.
# Every kill lands after a commit, so each resume restores batches sampled ahead (a kill before the
# first commit restarts from scratch; a kill inside the commit is the synchronous contract's table,
# the same code: tests/scenarios/test_resume_contract.py).
KILL_CHAINS = {
    1: [
        "batch_received:3",  # step 3's batch, sampled during step 2 and committed with it, not trained
        "rollout:generate:2",  # the restarted replica dies at its second request (rc 1, not a kill)
    ],
    2: ["weight_sync:3"],  # the first tensor of step 3's weights sent: the resume needs both batches ahead
}


def tree(assets: Path, root: Path, k: int) -> dict:
    return small_config_tree(
        assets,
        root,
        rl={"steps": STEPS, "log_every": 1},
        rollout={"mode": "server", "off_policy_steps": k, "generate_batch": 8, "bucket_mb": 0.05, "threads": 1},
        checkpoint={"every_steps": 2, "keep_last": 2, "consolidate_every": 2},
        run={"threads": 1},
    )


def call(root: Path, trained):
    sft_dir, rm_dir, norm = trained
    return rl_call(root, sft_dir, rm_dir, norm, critic=rm_dir)


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in stable(metrics).items() if k != "rollout/sync_gb_per_s"}


@pytest.mark.parametrize("k", sorted(KILL_CHAINS))
def test_an_off_policy_run_killed_anywhere_ends_bitwise_like_an_uninterrupted_one(k, small_assets, trained, tmp_path):
    ref_root, root = tmp_path / "ref", tmp_path / "killed"
    ref_root.mkdir(), root.mkdir()
    ref_proc = start_worker(ref_root, tree(small_assets, ref_root, k), call(ref_root, trained), None)

    stage_call, stage_tree = call(root, trained), tree(small_assets, root, k)
    store, logged, resumes = CheckpointStore(stage_call.store_url), [], []
    for fault in KILL_CHAINS[k] + [None]:
        resumes.append(store.latest())
        rc, metrics, err = finish_worker(start_worker(root, stage_tree, stage_call, fault))
        if fault is None:
            assert rc == 0, err
        elif fault.startswith("rollout:generate"):  # the trainer sees its worker die and fails cleanly
            assert rc not in (0, KILLED_EXIT_CODE) and "rollout replica" in err, f"{fault}: exit {rc}\n{err}"
        else:
            assert rc == KILLED_EXIT_CODE, f"{fault}: exit {rc}\n{err}"
        logged += metrics
    assert resumes[1:].count(None) < len(resumes) - 1, "no run resumed from a checkpoint"

    rc, reference, err = finish_worker(ref_proc)
    assert rc == 0, err
    by_step = {step: comparable(m) for step, m in reference}
    for step in range(1, STEPS + 1):  # batch t sampled by version max(0, t-1-k), on every row
        assert by_step[step]["rollout/staleness_max"] == min(k, step - 1)
        assert by_step[step]["rollout/staleness_mean"] == min(k, step - 1)
        assert by_step[step]["rollout/logprob_diff_max"] < 1e-4  # the probe after every sync
    # the behaviour log-probs are the sampler's: equal to the trainer's only while no update lies between
    assert abs(by_step[1]["rollout/is_weight_max"] - 1) < 1e-4 and by_step[1]["rollout/mismatch_kl"] < 1e-6
    assert all(by_step[step]["rollout/mismatch_kl"] > 1e-6 for step in range(2, STEPS + 1))
    for step, metrics in logged:
        assert comparable(metrics) == {k_: by_step[step][k_] for k_ in comparable(metrics)}, f"step {step} differs"
    assert {s for s, _ in logged} >= set(by_step)
    assert final_files(stage_call.store_url) == final_files(f"{ref_root}/rl")
    outcome = json.loads((root / "outcome.json").read_text())
    assert outcome["resumed_from"] == resumes[-1]
