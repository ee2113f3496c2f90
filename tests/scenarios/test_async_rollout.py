"""rollout.async: the worker samples on while PPO trains, weights go to it mid-stream (partial
rollouts on), and a run SIGKILLed at random moments keeps the three promises of resume.

PPO (with its critic) runs as `python -m rlflow.engine.stages.worker` subprocesses with an `hf`
rollout replica. The first run is SIGKILLed at a random moment after its first checkpoint: the
trainer (its replica then exits by itself) or the rollout replica (the trainer then stops with an
error naming it), chosen at random; the second run resumes and finishes. (One kill: the suite's
time budget; the scripted-stream tests in tests/unit/engine/rollout/test_streaming.py resume
from every kind of buffer state.)
Checked on what the runs logged and on every checkpoint's buffer (engine/rollout/streaming.py):
- nothing trained on in a committed step is trained on again;
- every group a resumed checkpoint held is trained on (or dropped as too stale) afterwards, and
  what was in flight at it is counted in rollout/discarded_on_resume;
- the staleness bound holds on every trained row, right after each restart too.
"""

import json
import os
import random
import signal
import time
from pathlib import Path

from conftest import small_config_tree
from helpers.stage_ctx import rl_call
from helpers.stage_worker import finish_worker, start_worker
from rlflow.engine.rollout.streaming import from_ranges
from rlflow.engine.stages.rl.stage import ROLLOUT_BUFFER_FILE
from rlflow.engine.storage.checkpoint import CheckpointStore

STEPS, STALENESS, BATCH = 8, 1, 8


def tree(assets: Path, root: Path) -> dict:
    return small_config_tree(
        assets,
        root,
        rl={"steps": STEPS, "log_every": 1, "rollout_batch": BATCH, "mini_batch": BATCH},
        rollout={
            "mode": "server",
            "async": True,
            "max_staleness": STALENESS,
            "partial_rollouts": True,
            "generate_batch": 4,
            "bucket_mb": 0.05,
            "threads": 1,
        },
        checkpoint={"every_steps": 1, "keep_last": STEPS, "consolidate_every": 100},
        run={"threads": 1},
    )


def call(root: Path, trained):
    sft_dir, rm_dir, norm = trained
    return rl_call(root, sft_dir, rm_dir, norm, critic=rm_dir)


def rollout_worker_pid(trainer_pid: int) -> int | None:
    for child in Path(f"/proc/{trainer_pid}/task/{trainer_pid}/children").read_text().split():
        if b"rlflow.engine.rollout.hf_replica" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    return None


def kill_after_a_checkpoint(proc, store: CheckpointStore, newer_than: int, victim: str, delay_s: float) -> None:
    """SIGKILL the trainer `proc` or its rollout replica `delay_s` after the trainer commits a step
    past `newer_than` (nothing if it ended first). A step takes ~0.2 s here."""
    deadline = time.monotonic() + 240
    while proc.poll() is None and (store.latest() or 0) <= newer_than and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(delay_s)
    try:
        pid = proc.pid if victim == "trainer" else rollout_worker_pid(proc.pid)
        if pid is not None and proc.poll() is None:
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):  # it finished meanwhile
        pass


def buffer_at(store: CheckpointStore, step: int) -> dict:
    return store.read_json(step, ROLLOUT_BUFFER_FILE)["async"]


def test_an_async_run_killed_at_random_moments_loses_nothing_committed_and_repeats_nothing(
    small_assets, trained, tmp_path
):
    seed = int.from_bytes(os.urandom(4))  # other moments on every run of the test: named on failure
    rng, seed_note = random.Random(seed), f"kill delays of random.Random({seed})"
    victim = rng.choice(["trainer", "worker"])
    # A kill that lands after the run has ended (a fast machine) proves nothing: try again in a fresh
    # root, killing on the first commit.
    for attempt, delay_s in enumerate((rng.uniform(0.0, 0.6), 0.0, 0.0)):
        root = tmp_path / f"attempt-{attempt}"
        root.mkdir()
        stage_call, stage_tree = call(root, trained), tree(small_assets, root)
        store = CheckpointStore(stage_call.store_url)
        proc = start_worker(root, stage_tree, stage_call, None)
        kill_after_a_checkpoint(proc, store, 0, victim, delay_s)
        rc, metrics, err = finish_worker(proc)
        if rc != 0:
            break
    logged = [[(s, m) for s, m in metrics if "actor/kl" in m]]  # the training steps' events
    if victim == "trainer":
        assert rc == -signal.SIGKILL, f"{seed_note}: exit {rc}\n{err}"
    else:  # the trainer sees its worker die and stops with an error naming it, no hang
        assert rc not in (0, -signal.SIGKILL) and "rollout replica" in err, f"{seed_note}: exit {rc}\n{err}"
    resumed_at = [None, store.latest()]
    assert resumed_at[1] is not None, f"{seed_note}: killed before its first commit"
    rc, metrics, err = finish_worker(start_worker(root, stage_tree, stage_call, None))
    logged.append([(s, m) for s, m in metrics if "actor/kl" in m])
    assert rc == 0, f"{seed_note}: {err}"

    final = buffer_at(store, STEPS)
    trained_groups = from_ranges(final["fates"]["trained"])
    # 1. nothing trained twice; every step trained B groups
    assert len(trained_groups) == len(set(trained_groups)) == STEPS * BATCH, seed_note
    # every group before the stream position has exactly one fate; none is sampled past the last step
    accounted = trained_groups + [g for f in ("dropped", "discarded") for g in from_ranges(final["fates"][f])]
    assert sorted(accounted) == list(range(final["next_group"])), seed_note
    assert final["ready"] == [] and final["in_flight"] == [], seed_note
    for run, start in zip(logged[1:], resumed_at[1:]):
        if start is None:
            continue
        held = buffer_at(store, start)
        # 2. what the resumed checkpoint committed is trained on later, what it had in flight is counted
        for group in held["ready"]:
            assert set(group["groups"]) <= set(trained_groups) | set(from_ranges(final["fates"]["dropped"]))
        lost = len(from_ranges(held["in_flight"]))
        if run:  # (a run killed before its first step's event logged nothing)
            assert {m["rollout/discarded_on_resume"] for _, m in run} == {float(lost)}, seed_note
        assert set(from_ranges(held["in_flight"])) <= set(from_ranges(final["fates"]["discarded"]))
    # 3. the bound on every trained row (the stage raises if a row exceeds it), restarts included
    steps = [(s, m) for run in logged for s, m in run]
    assert steps and all(m["rollout/staleness_max"] <= STALENESS for _, m in steps), seed_note
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for _, m in steps)  # the probe after every sync
    assert any(m["rollout/staleness_max"] >= 1 for _, m in steps)  # sampled ahead, really
    ran = {"resumed_at": resumed_at, "killed": victim, "attempts": attempt + 1, "steps": len(steps), "seed": seed}
    print(json.dumps(ran))  # with -s: what ran

