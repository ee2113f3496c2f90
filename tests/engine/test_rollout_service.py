"""PPO with its rollouts from an `hf` worker process (rollout.mode=server): the same numbers as
colocated sampling, the guard metrics every step, and a skipped or partial weight sync inside the
PPO loop stops the stage."""

import pytest

from conftest import RecordingSink, small_config_tree
from rlflow.engine.config import build_config
from rlflow.engine.ppo_stage import PPOInputs, run_ppo_stage
from rlflow.engine.rollout_service import RolloutService
from rlflow.engine.weight_sync import WeightSyncError
from test_sft_rm import make_ctx

STEPS = 3


def zero_gold(prompt, response, **fields):
    return 0.0


def run(trained, small_assets, tmp_path, name, mode, check_fingerprint=True):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(
            small_assets,
            tmp_path,
            ppo={"steps": STEPS, "rollout_batch": 16, "mini_batch": 8, "actor_lr": 1e-3},
            rollout={"mode": mode, "generate_batch": 8, "bucket_mb": 0.05, "check_fingerprint": check_fingerprint},
        ),
        "t",
    )
    sink = RecordingSink()
    inputs = PPOInputs(sft_dir, sft_dir, sft_dir, rm_dir, norm, rm_dir)
    ctx = make_ctx(tmp_path / name, "ppo", sink=sink, every=100)
    run_ppo_stage(ctx, inputs, cfg.model, cfg.ppo, cfg.eval, cfg.data, cfg.checkpoint, zero_gold, cfg.rollout)
    return sink


def test_server_rollouts_train_exactly_like_colocated_ones(trained, small_assets, tmp_path):
    colocated = run(trained, small_assets, tmp_path, "colocated", "colocated")
    served = run(trained, small_assets, tmp_path, "server", "server")
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "critic/vf_loss", "actor/kl"):
        expected = [v for _, v in colocated.series(key)]
        assert [v for _, v in served.series(key)] == pytest.approx(expected, abs=1e-4), key
    diffs = [v for _, v in served.series("rollout/logprob_diff_max")]
    assert len(diffs) == STEPS and max(diffs) < 1e-4  # the guard ran every step and saw agreement
    assert len(served.series("timing_s/update_weights")) == STEPS
    assert all(v > 0 for _, v in served.series("rollout/sync_gb_per_s"))


# The client-level tests (test_rollout_server.py) cover both faults with and without fingerprints;
# here the PPO loop itself: the probe alone catches a skipped sync, the fingerprint a partial one.
@pytest.mark.parametrize("fault,check_fingerprint", [("skip", False), ("partial", True)])
def test_a_bad_sync_inside_the_ppo_loop_stops_the_stage(
    trained, small_assets, tmp_path, monkeypatch, fault, check_fingerprint
):
    real_sync = RolloutService.sync

    def faulty_sync(self, actor):
        if self.client is None or not hasattr(self, "_synced_once"):  # the first sync (at start) goes through
            self._synced_once = True
            return real_sync(self, actor)
        if fault == "skip":
            return {}
        half = [(n, p) for i, (n, p) in enumerate(actor.named_full_parameters()) if i % 2 == 0]
        stats = self.client.update_weights(half, self.cfg.bucket_mb)
        from rlflow.engine.weight_sync import weights_fingerprint

        self.trainer_fingerprint = weights_fingerprint(actor.named_full_parameters(), round_to=self.client.dtype)
        self.worker_fingerprint = self.client.fingerprint()
        return {"rollout/sync_gb_per_s": stats.gb_per_s}

    monkeypatch.setattr(RolloutService, "sync", faulty_sync)
    expected = "weight fingerprints differ" if check_fingerprint else r"log-prob diff max \S+ nats"
    with pytest.raises(WeightSyncError, match=expected):
        run(trained, small_assets, tmp_path, fault, "server", check_fingerprint)
