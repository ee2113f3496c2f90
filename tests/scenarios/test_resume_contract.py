"""The resume contract: a stage killed anywhere and started again ends exactly where an
uninterrupted run ends.

Each training stage runs as `python -m rlflow.engine.stages.worker` subprocesses (no Prefect): one
uninterrupted reference run, then a chain of runs each killed by RLFLOW_FAULT at the next kill
point, then one that finishes. The finished stage's checkpoint must be byte-identical to the
reference's (every file's sha256: weights, optimizer shards, schedule and RNG state), and every
metric any run logged at any step must equal the reference's at that step (timing_s/*, perf/*
and checkpoint/* excluded). PPO logs `rollout/response_ids_crc32` every step, so equal metrics
also mean the same sampled token ids after every restart.
"""

import json
from pathlib import Path

import pytest

from conftest import small_config_tree
from helpers.stage_ctx import make_call, model, rl_call, sft_call
from rlflow.engine.stages.reward_model import RewardModelUpstream
from helpers.stage_worker import final_files, finish_worker, stable, start_worker
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.faults import KILLED_EXIT_CODE
from rlflow.engine.stages.worker import StageCall

# stage -> the kill points its chain goes through, in order (RLFLOW_FAULT "<stage>:<event>:<step>").
# Checkpoints every 2 steps; consolidated (whole HF model) at 4 and at the end.
KILL_CHAINS = {
    "sft": ["update:3", "ckpt_inside:4", "before_final:6"],
    "rm": ["ckpt_files:4"],
    "rl": ["rollout:2", "ckpt_manifest:4"],
}


def stage_tree(assets: Path, root: Path) -> dict:
    return small_config_tree(
        assets,
        root,
        sft={"max_steps": 6, "eval_every": 3, "batch_size": 16, "warmup_steps": 1, "log_every": 1},
        rm={"batch_size": 64, "log_every": 1},
        rl={"steps": 5, "log_every": 1},
        rollout={"generate_batch": 8},  # two chunks per step: the rollout kill lands between them
        checkpoint={"every_steps": 2, "keep_last": 2, "consolidate_every": 2},
        run={"threads": 1},
    )


def stage_call(stage: str, root: Path, assets: Path, trained) -> StageCall:
    sft_dir, rm_dir, score_norm = trained
    if stage == "sft":
        return sft_call(root, assets / "tiny-model")
    if stage == "rm":
        return make_call(root, "rm", RewardModelUpstream(init=model(sft_dir)))
    return rl_call(root, sft_dir, rm_dir, score_norm, critic=rm_dir)


@pytest.mark.parametrize("stage", list(KILL_CHAINS))
def test_killed_anywhere_and_continued_ends_exactly_like_an_uninterrupted_run(
    stage, small_assets, trained, tmp_path_factory
):
    ref_root, root = tmp_path_factory.mktemp(f"ref-{stage}"), tmp_path_factory.mktemp(f"killed-{stage}")
    ref_tree = stage_tree(small_assets, ref_root)
    ref_proc = start_worker(ref_root, ref_tree, stage_call(stage, ref_root, small_assets, trained), None)

    call, tree = stage_call(stage, root, small_assets, trained), stage_tree(small_assets, root)
    store, logged, resumes = CheckpointStore(call.store_url), [], []
    for fault in KILL_CHAINS[stage] + [None]:
        resumes.append(store.latest())
        rc, metrics, err = finish_worker(start_worker(root, tree, call, fault))
        assert rc == (KILLED_EXIT_CODE if fault else 0), f"{fault}: exit {rc}\n{err}"
        logged += metrics
        if fault:  # what a death leaves: every committed step whole, a torn one not committed
            assert store.final() is None, f"{fault}: the stage must not be marked finished"
            for step in store.committed_steps():
                store.verify(step)
            event, at = fault.split(":")
            assert event not in ("ckpt_inside", "ckpt_files") or int(at) not in store.committed_steps()
    assert any(r is not None for r in resumes[1:]), "no run resumed from a checkpoint"

    rc, reference, err = finish_worker(ref_proc)
    assert rc == 0, err
    by_step = {step: stable(m) for step, m in reference}
    assert len(by_step) == len(reference), "a step was logged twice in one run"

    for step, metrics in logged:
        expected = {k: by_step[step][k] for k in stable(metrics) if k in by_step.get(step, {})}
        assert stable(metrics) == expected, f"step {step} differs from the uninterrupted run"
    assert {s for s, _ in logged} >= set(by_step), "a step's metrics were never logged"
    assert final_files(call.store_url) == final_files(f"{ref_root}/{stage}")
    outcome = json.loads((root / "outcome.json").read_text())
    assert outcome["resumed_from"] == resumes[-1] and outcome["step"] == max(by_step)
    if stage == "rl":  # every RL step of every run logged its sampled ids' checksum
        assert all("rollout/response_ids_crc32" in m for _, m in logged if "actor/kl" in m)
    resume_s = [m["checkpoint/resume_s"] for _, m in logged if "checkpoint/resume_s" in m]
    assert len(resume_s) == sum(r is not None and r < max(by_step) for r in resumes) and all(t > 0 for t in resume_s)
