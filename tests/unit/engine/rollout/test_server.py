"""Rollout as a service: real worker processes against colocated generation, the weight-sync guard
(fingerprint and log-prob probe) on skipped and partial syncs, and worker death.

One shared worker on the tiny demo model (module scope: its weights carry over from test to test,
and the kill test ends it), plus the short-lived ones that failure and orphan tests need.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from rlflow.engine.models.loading import load_policy, load_tokenizer, token_logprobs
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.rollout.served import build_rollout_batch, probe_weight_sync
from rlflow.engine.rollout.server import RolloutClient, RolloutWorkerError
from rlflow.engine.rollout.weight_sync import WeightSyncError, iter_buckets, weights_fingerprint

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24)
SEED = 0  # with these prompts some rows stop at EOS early: the response mask is exercised
SMALL_BUCKET_MB = 0.1  # the tiny model (1.5 MB) travels in 16 buckets


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here and in the workers: on 2 shared cores, two processes spinning two
    OpenMP threads each run 5-30x slower. Both sides use the same count, as in production."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny(small_assets):
    model_dir = str(small_assets / "tiny-model")
    tokenizer = load_tokenizer(model_dir)
    with open(small_assets / "data" / "prompts.jsonl") as f:
        texts = [json.loads(line)["prompt"] for line in f][:16]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return model_dir, tokenizer, prompts


@pytest.fixture(scope="module")
def policy(tiny):
    """The trainer's policy; tests change it like training would (state carries over)."""
    return load_policy(tiny[0])


@pytest.fixture(scope="module")
def client(tiny, tmp_path_factory):
    model_dir, tokenizer, _ = tiny
    log = str(tmp_path_factory.mktemp("worker") / "worker.log")
    c = RolloutClient.start("hf", model_dir, tokenizer=tokenizer, startup_timeout_s=120, threads=1, log_path=log)
    yield c
    killed = c.proc.poll() is not None  # by the kill test, the last one to use this worker
    c.close()
    assert killed or c.proc.returncode == 0  # a clean close: the worker exits by itself


def perturb(policy, seed, scale=0.01):
    """A training-like change of every parameter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def served(client, prompts):
    """The worker's samples of `prompts` as the RolloutBatch generate_rollouts would build."""
    generation = client.generate(prompts, PARAMS, SEED)
    return build_rollout_batch(client.tokenizer, prompts, generation, PARAMS.max_new_tokens)


def probe(client, policy, prompts, check_fingerprint=True):
    batch = served(client, prompts)
    return probe_weight_sync(
        client,
        policy,
        batch,
        PARAMS.temperature,
        probe_rows=4,
        max_logprob_diff=1e-3,
        check_fingerprint=check_fingerprint,
    )


# --- one tiny worker, in order --------------------------------------------------------------------


def test_pipelined_generations_come_back_in_order_and_block_other_requests(client, tiny):
    _, _, prompts = tiny
    sequential = [client.generate(prompts, PARAMS, seed) for seed in (SEED, SEED + 1)]
    client.submit(prompts, PARAMS, SEED)
    client.submit(prompts, PARAMS, SEED + 1)
    assert client.outstanding == 2
    with pytest.raises(RolloutWorkerError, match="2 generation.*outstanding; collect"):
        client.fingerprint()  # its reply would be a generation's
    assert [client.collect(), client.collect()] == sequential
    assert sequential[0] != sequential[1] and client.outstanding == 0
    with pytest.raises(RolloutWorkerError, match="no generate request outstanding"):
        client.collect()
    client.fingerprint()  # the connection is still in step


def test_fingerprint_runs_the_trainers_hash_while_the_worker_hashes_and_survives_its_failure(client, policy, tiny):
    _, _, prompts = tiny
    ran = []
    worker_fp = client.fingerprint(meanwhile=lambda: ran.append(weights_fingerprint(policy.named_parameters())))
    assert ran == [worker_fp]  # the two sides hashed the same weights

    def broken() -> None:
        raise ValueError("the trainer's gather failed")

    with pytest.raises(ValueError, match="gather failed"):
        client.fingerprint(meanwhile=broken)
    # the worker's reply was read anyway: the next replies are still the requests' own
    assert client.fingerprint() == worker_fp
    assert client.generate(prompts, PARAMS, SEED) == client.generate(prompts, PARAMS, SEED)


def test_server_generation_equals_colocated(client, policy, tiny):
    _, tokenizer, prompts = tiny
    batch = served(client, prompts)
    colocated = generate_rollouts(policy, tokenizer, prompts, PARAMS, SEED)
    assert torch.equal(batch.input_ids, colocated.input_ids)
    assert torch.equal(batch.attention_mask, colocated.attention_mask)
    assert torch.equal(batch.response_mask, colocated.response_mask)
    assert batch.prompt_width == colocated.prompt_width and batch.response_texts == colocated.response_texts
    assert batch.response_mask.sum(1).min() < PARAMS.max_new_tokens  # some rows ended at EOS
    with torch.no_grad():
        trainer, _ = token_logprobs(policy, batch.input_ids, batch.attention_mask, batch.prompt_width, 1.0)
    assert torch.allclose(trainer * batch.response_mask, batch.sampled_logprobs, atol=1e-5, rtol=0)
    assert torch.allclose(colocated.sampled_logprobs, batch.sampled_logprobs, atol=1e-6, rtol=0)
    assert client.fingerprint() == weights_fingerprint(policy.named_parameters())


def test_full_sync_after_a_training_like_change(client, policy, tiny):
    prompts = tiny[2]
    perturb(policy, seed=1)
    stats = client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB)
    assert stats.buckets >= 4 and stats.tensors == len(list(policy.parameters()))
    assert stats.bytes == sum(p.numel() * 4 for p in policy.parameters()) and stats.gb_per_s > 0
    check = probe(client, policy, prompts)
    assert check.fingerprint_match and check.logprob_diff_max < 1e-5
    colocated = generate_rollouts(policy, tiny[1], prompts, PARAMS, SEED)  # still token-identical
    assert torch.equal(served(client, prompts).input_ids, colocated.input_ids)


@pytest.mark.parametrize("check_fingerprint", [True, False])
def test_skipped_sync_is_caught(client, policy, tiny, check_fingerprint):
    prompts = tiny[2]
    client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB)  # start in step
    perturb(policy, seed=2)  # ...and the trainer forgets to sync
    with pytest.raises(WeightSyncError) as err:
        probe(client, policy, prompts, check_fingerprint)
    check = err.value.check
    assert check.logprob_diff_max > 0.05  # 50x the default rollout.max_logprob_diff
    assert "log-prob diff max" in str(err.value) and "rollout.max_logprob_diff=0.001" in str(err.value)
    if check_fingerprint:
        assert check.fingerprint_match is False and "fingerprints differ" in str(err.value)
    else:
        assert check.fingerprint_match is None and "fingerprint" not in str(err.value)


@pytest.mark.parametrize("check_fingerprint", [True, False])
def test_partial_sync_is_caught(client, policy, tiny, check_fingerprint):
    prompts = tiny[2]
    client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB)
    perturb(policy, seed=3)
    buckets = list(iter_buckets(policy.named_parameters(), int(SMALL_BUCKET_MB * 2**20)))
    assert len(buckets) >= 4
    first_half = [(e.name, t) for b in buckets[: len(buckets) // 2] for e, t in zip(b.entries, b.tensors)]
    stats = client.update_weights(first_half, bucket_mb=SMALL_BUCKET_MB)
    assert stats.buckets == len(buckets) // 2
    with pytest.raises(WeightSyncError) as err:
        probe(client, policy, prompts, check_fingerprint)
    assert err.value.check.logprob_diff_max > 0.05
    assert ("fingerprints differ" in str(err.value)) == check_fingerprint


def test_socket_transport_syncs_too(client, policy, tiny):
    perturb(policy, seed=4)
    client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB, transport="socket")
    assert probe(client, policy, tiny[2]).logprob_diff_max < 1e-5


# --- throughput, then death (the shared worker's last tests) -------------------------------------


def test_weight_sync_throughput(client, policy):
    """Printed, not asserted: the tiny model's 1.5 MB of parameters 64 times over (96 MB, 1280 small
    tensors, so per-tensor overhead shows; docs/rollout-protocol.md has a 169 MB model's figures)."""
    named = list(policy.named_parameters()) * 64
    for transport in ("shm", "socket"):
        runs = [client.update_weights(named, bucket_mb=32, transport=transport) for _ in range(3)]
        best = max(runs, key=lambda s: s.gb_per_s)
        print(
            f"\nweight sync {transport}: {best.bytes / 1e6:.0f} MB in {best.buckets} buckets, {best.gb_per_s:.2f} GB/s"
        )
    assert client.fingerprint() == weights_fingerprint(policy.named_parameters())


def test_worker_killed_mid_request_is_a_clear_error(client, tiny):
    prompts = tiny[2] * 4
    killer = threading.Timer(0.3, os.kill, (client.pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RolloutWorkerError) as err:
        client.generate(prompts, SamplingParams(max_new_tokens=200), seed=0)  # 12800 tokens: seconds of work
    killer.join()
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert f"rollout worker hf (pid {client.pid}) died with exit code -9 while handling 'generate'" in message
    assert "last lines: " in message and f"rollout-worker[{client.pid}]" in message  # its own log, quoted
    with pytest.raises(RolloutWorkerError, match="died"):  # and stays an error, never a hang
        client.fingerprint()


# --- start-up failures and orphans ----------------------------------------------------------------


def test_worker_that_cannot_start_reports_its_log(tmp_path, tiny):
    with pytest.raises(RolloutWorkerError, match=r"died with exit code 2 while starting.*does not exist"):
        RolloutClient.start("hf", str(tmp_path / "missing"), tokenizer=tiny[1], log_path=str(tmp_path / "a.log"))
    with pytest.raises(RolloutWorkerError, match=r"did not become ready within 0\.5 s \(rollout\.startup_timeout_s\)"):
        RolloutClient.start("hf", tiny[0], tokenizer=tiny[1], startup_timeout_s=0.5, log_path=str(tmp_path / "b.log"))
    with pytest.raises(RolloutWorkerError, match=r"unknown rollout.server_backend 'vllm'; use one of \['hf'\]"):
        RolloutClient.start("vllm", tiny[0], tokenizer=tiny[1])  # a vLLM replica is vllm_replica.py's


TRAINER_SCRIPT = """
import sys
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.server import RolloutClient
client = RolloutClient.start("hf", sys.argv[1], startup_timeout_s=120, threads=1, log_path=sys.argv[2])
print(client.pid, flush=True)
client.generate([[5, 6, 7]] * 256, SamplingParams(max_new_tokens=240), seed=0)  # a minute of work: killed during it
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # a zombie has exited; its reaper may be slow
    except FileNotFoundError:
        return True


def test_worker_exits_when_the_trainer_dies_mid_request(tiny, tmp_path):
    command = [sys.executable, "-c", TRAINER_SCRIPT, tiny[0], str(tmp_path / "worker.log")]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(trainer.stdout.readline())
        time.sleep(0.3)  # the worker is generating: only its parent watchdog can notice
    finally:
        trainer.kill()  # SIGKILL: no finalizers, no close()
        trainer.wait()
    deadline = time.monotonic() + 3  # the watchdog polls every 0.5 s; the generation would take far longer
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker_pid)
    assert "trainer process" in (tmp_path / "worker.log").read_text()  # the watchdog, not a broken pipe, ended it
