"""PPO with its rollouts from a replica (rollout.mode=server: HF, and vLLM as an external fleet): the
same numbers as colocated sampling, the guard metrics every step, and a skipped or partial weight sync inside the
PPO loop stops the stage; and the service's own bookkeeping (chunks, the guard, its metrics)."""

import pytest
import torch

from conftest import RecordingSink, rl_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.config.execution import RolloutConfig
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.config.schema import build_config
from rlflow.engine.models.loading import load_tokenizer
from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.rollout.replica import Generation
from rlflow.engine.rollout.service import RolloutService
from rlflow.engine.rollout.weight_sync import WeightSyncError

STEPS = 3


def train(trained, small_assets, tmp_path, name, mode, check_fingerprint=True, model=None, **rollout):
    sft_dir, rm_dir, norm = trained
    cfg = build_config(
        small_config_tree(
            small_assets,
            tmp_path,
            **({"model": model} if model else {}),
            rl={"steps": STEPS, "rollout_batch": 16, "mini_batch": 8, "actor_lr": 1e-3},
            rollout={"mode": mode, "generate_batch": 8, "bucket_mb": 0.05, "check_fingerprint": check_fingerprint}
            | rollout,
        ),
        "t",
    )
    sink = RecordingSink()
    run(make_ctx(tmp_path / name, "rl", sink=sink, every=100), rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir))
    return sink


def test_server_rollouts_train_exactly_like_colocated_ones(trained, small_assets, tmp_path):
    colocated = train(trained, small_assets, tmp_path, "colocated", "colocated")
    served = train(trained, small_assets, tmp_path, "server", "server")
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "critic/vf_loss", "actor/kl"):
        expected = [v for _, v in colocated.series(key)]
        assert [v for _, v in served.series(key)] == pytest.approx(expected, abs=1e-4), key
    diffs = [v for _, v in served.series("rollout/logprob_diff_max")]
    assert len(diffs) == STEPS and max(diffs) < 1e-4  # the guard ran every step and saw agreement
    # The HF replica samples with the trainer's weights (k = 0): its log-probs are the behaviour
    # policy's and the trainer's both, so rollout correction weighs every token 1.
    assert all(abs(v - 1.0) < 1e-6 for _, v in served.series("rollout/is_weight_mean"))
    assert all(abs(v - 1.0) < 1e-5 for _, v in served.series("rollout/is_weight_max"))
    assert [v for _, v in served.series("rollout/staleness_max")] == [0.0] * STEPS
    assert len(served.series("timing_s/update_weights")) == STEPS
    assert all(v > 0 for _, v in served.series("rollout/sync_gb_per_s"))


def test_a_bf16_replica_keeps_the_guard_green_with_its_dtypes_stop_and_the_correction_sees_its_gap(
    trained, small_assets, tmp_path
):
    """rollout.dtype=bfloat16: the replica samples in bf16, the weights are checked exactly (the
    trainer's fingerprint rounded to bf16), and the log-prob gap, far above fp32's 1e-3 stop, stays
    under bf16's (LOGPROB_DIFF_STOPS) and shows in the correction's metrics."""
    served = train(trained, small_assets, tmp_path, "bf16", "server", dtype="bfloat16", threads=1)
    diffs = [v for _, v in served.series("rollout/logprob_diff_max")]
    assert len(diffs) == STEPS and 1e-3 < max(diffs) < 5.0
    assert all(v > 0 for _, v in served.series("rollout/mismatch_kl"))


@pytest.fixture(scope="module")
def fleet(trained):
    """One vLLM replica of the SFT model that rlflow did not start (an external fleet,
    rollout.endpoints): every vLLM run of this module samples from it in turn, as each round of a
    flow does from a fleet that outlives it. The replicas a stage starts itself are
    tests/scenarios/test_vllm_faults.py's and test_fleet.py's."""
    from helpers.vllm_env import vllm_python
    from rlflow.engine.rollout.vllm_replica import VLLMOptions, VLLMReplica

    replica = VLLMReplica.start(trained[0], python=vllm_python(), options=VLLMOptions(cores="1"))
    yield replica
    replica.close()


def train_on(fleet, monkeypatch, trained, small_assets, tmp_path, name, **kw):
    """train() with its rollouts from the external replica (its key from the environment, the
    weights over the gloo group); the replica is still running after."""
    from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV

    monkeypatch.setenv(REPLICA_KEY_ENV, fleet.key)
    served = train(trained, small_assets, tmp_path, name, "server", server_backend="vllm", endpoints=[fleet.url], **kw)
    assert fleet.proc.poll() is None  # rlflow leaves an external replica running
    return served


def test_an_external_vllm_fleet_gets_its_weights_over_gloo(fleet, monkeypatch, trained, small_assets, tmp_path):
    """rollout.endpoints: a replica someone else started (rlflow starts nothing); the PPO loop's
    weights reach it through the gloo group, the guard green every step."""
    served = train_on(fleet, monkeypatch, trained, small_assets, tmp_path, "external")
    diffs = [v for _, v in served.series("rollout/logprob_diff_max")]
    assert len(diffs) == STEPS and max(diffs) < 1e-3


def test_vllm_rollouts_of_a_lora_actor_get_its_merged_weights(fleet, monkeypatch, trained, small_assets, tmp_path):
    """LoRA with vLLM: the replica holds plain weights, and each sync sends the adapters merged in
    under the plain names (what the fingerprint and the probe check). The replica held another
    run's weights before: the first sync replaces them all, or the probe would fail."""
    lora = {"lora": {"r": 4, "alpha": 8.0}}
    served = train_on(fleet, monkeypatch, trained, small_assets, tmp_path, "lora", model=lora, threads=1)
    diffs = [v for _, v in served.series("rollout/logprob_diff_max")]
    assert len(diffs) == STEPS and max(diffs) < 1e-3


@pytest.mark.parametrize(
    "schedule",
    [{"off_policy_steps": 1}, {"async": True, "max_staleness": 1, "partial_rollouts": True}],
    ids=["off_policy_1", "async_partial"],
)
def test_vllm_rollouts_sample_ahead_within_the_staleness_bound(
    fleet, monkeypatch, trained, small_assets, tmp_path, schedule
):
    """Off-policy (the replica samples step t+1 while the trainer trains t) and asynchronous with
    partial rollouts (an update freezes generations in flight, vLLM's pause mode keep, and they go on
    under the new weights): the probe after each sync agrees, and no trained row is staler than the bound."""
    served = train_on(fleet, monkeypatch, trained, small_assets, tmp_path, "ahead", threads=1, **schedule)
    assert len(served.series("actor/pg_loss")) == STEPS
    assert max(v for _, v in served.series("rollout/staleness_max")) <= 1
    diffs = [v for _, v in served.series("rollout/logprob_diff_max")]
    assert diffs and max(diffs) < 1e-3


# The client-level tests (test_server.py) cover both faults with and without fingerprints;
# here the PPO loop itself: the probe alone catches a skipped sync, the fingerprint a partial one.
@pytest.mark.parametrize("fault,check_fingerprint", [("skip", False), ("partial", True)])
def test_a_bad_sync_inside_the_rl_loop_stops_the_stage(
    trained, small_assets, tmp_path, monkeypatch, fault, check_fingerprint
):
    real_sync = RolloutService.sync

    def faulty_sync(self, actor, version, step=0):
        if self.client is None or not hasattr(self, "_synced_once"):  # the first sync (at start) goes through
            self._synced_once = True
            return real_sync(self, actor, version, step)
        if fault == "skip":
            return {}
        half = [(n, p) for i, (n, p) in enumerate(actor.named_full_parameters()) if i % 2 == 0]
        stats = self.client.update_weights(half, self.cfg.bucket_mb)
        from rlflow.engine.rollout.weight_sync import weights_fingerprint

        self.trainer_fingerprint = weights_fingerprint(actor.named_full_parameters(), round_to=self.client.dtype)
        self.replica_fingerprint = self.client.fingerprint()
        return {"rollout/sync_gb_per_s": stats.gb_per_s}

    monkeypatch.setattr(RolloutService, "sync", faulty_sync)
    expected = "weight fingerprints differ" if check_fingerprint else r"log-prob diff max \S+ nats"
    with pytest.raises(WeightSyncError, match=expected):
        train(trained, small_assets, tmp_path, fault, "server", check_fingerprint)


# --- the service's own bookkeeping, without rollout replicas ----------------------------------------


class CannedWorker:
    """Stands in for the replica fleet (engine/rollout/replicas.py, processes of their own): returns
    fixed samples per seed and records the calls."""

    def __init__(self, samples):
        self.samples, self.calls = samples, []

    def generate(self, prompts, params, seed):
        self.calls.append((len(prompts), seed))
        return Generation(*self.samples[seed])


def test_sampled_chunks_carry_the_replicas_log_probs_masked_for_the_guard(small_assets):
    tokenizer = load_tokenizer(str(small_assets / "tiny-model"))
    eos = tokenizer.eos_token_id
    worker = CannedWorker({
        10: ([[7, eos], [8, 9, 5]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]]),
        11: ([[eos]], [[-4.0]]),
    })  # fmt: skip
    service = RolloutService(RolloutConfig(mode="server"), worker, tokenizer)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)
    batches = service.sample_chunks([(0, [[1, 2], [3]], 10), (1, [[4]], 11)], params)
    assert worker.calls == [(2, 10), (1, 11)]
    assert batches[0].response_ids.tolist() == [[7, eos, tokenizer.pad_token_id], [8, 9, 5]]
    assert batches[0].sampled_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert batches[1].sampled_logprobs.tolist() == [[-4.0]]


def sampled(replica_logprobs, mask):
    """A one-token-prompt batch whose sampler reported `replica_logprobs` [b, R] for `mask` [b, R]."""
    rows, width = mask.shape
    ids = torch.zeros(rows, 1 + width, dtype=torch.long)
    attention = torch.cat([torch.ones(rows, 1), mask], 1).long()
    return RolloutBatch(ids, attention, mask, 1, ("",) * rows, torch.tensor(replica_logprobs) * mask)


def test_the_guard_compares_fingerprints_once_per_sync_and_sums_the_diffs():
    service = RolloutService(RolloutConfig(mode="server", max_logprob_diff=0.1), client=None)
    service.trainer_fingerprint, service.replica_fingerprint = "sha256:a", "sha256:a"
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    first, second = sampled([[-1.0, -2.0, 0.0]], mask), sampled([[-1.0, -1.0, 0.0]], mask)
    total, tokens, worst = service.check(first, torch.tensor([[-1.02, -2.04, 0.0]]))
    assert (total, tokens, worst) == (pytest.approx(0.06), 2.0, pytest.approx(0.04))
    assert service.trainer_fingerprint is None  # compared: until the next sync
    service.check(second, torch.tensor([[-1.0, -1.0, 0.0]]))  # no fingerprints now: not compared
    metrics = RolloutService.metrics([(0.06, 2.0, 0.04), (0.0, 2.0, 0.0)])
    assert metrics == {"rollout/logprob_diff_mean": pytest.approx(0.015), "rollout/logprob_diff_max": 0.04}
    assert RolloutService.metrics([]) == {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}


def test_a_replica_out_of_step_fails_the_guard_with_the_numbers():
    service = RolloutService(RolloutConfig(mode="server", max_logprob_diff=0.01), client=None)
    service.trainer_fingerprint, service.replica_fingerprint = "sha256:a", "sha256:b"
    with pytest.raises(WeightSyncError, match=r"fingerprints differ.*log-prob diff max 0\.5 nats"):
        service.check(sampled([[0.0, 0.0]], torch.ones(1, 2)), torch.tensor([[0.5, 0.0]]))
