"""rlflow's HF replica as a process of its own, driven by the client that drives vLLM: samples equal to
colocated generation bit for bit, the weight-sync guard on full, skipped and partial syncs through each
channel, the key on every route, a pause that cuts a generation, and death.

One shared replica of the tiny demo model (module scope: its weights carry over from test to test,
and the kill test ends it), plus the short-lived ones that failure and orphan tests need.
"""

import json
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

from helpers.hf_replica import hf_client
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.rollout.generate import batched_logprobs, generate_rollouts
from rlflow.engine.rollout.replica import ReplicaClient, ReplicaError
from rlflow.engine.rollout.replica_model import model_signature
from rlflow.engine.rollout.replica_process import ReplicaStartError
from rlflow.engine.rollout.replicas import start_hf_replica
from rlflow.engine.rollout.served import build_rollout_batch
from rlflow.engine.rollout.weight_sync import WeightSyncError, check_weight_sync, iter_buckets, weights_fingerprint

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24)
SEED = 0  # with these prompts some rows stop at EOS early: the response mask is exercised
SMALL_BUCKET_MB = 0.1  # the tiny model (1.5 MB) travels in 16 buckets


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here and in the replica (both sides the same count, as in production)."""
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
def client(tiny, policy, tmp_path_factory):
    model_dir, tokenizer, _ = tiny
    replica, c = hf_client(model_dir, tokenizer, str(tmp_path_factory.mktemp("replica") / "replica.log"))
    c.pid = replica.proc.pid
    c.update_weights(policy.named_parameters(), SMALL_BUCKET_MB, version=0)  # version 0 of this run
    yield c
    c.close()


def perturb(policy, seed, scale=0.01):
    """A training-like change of every parameter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def served(client, prompts, params=PARAMS, seed=SEED):
    """The replica's samples of `prompts` as the RolloutBatch generate_rollouts would build."""
    generation = client.generate(prompts, params, seed)
    return build_rollout_batch(client.tokenizer, prompts, generation, params.max_new_tokens)


def probe(client, policy, prompts, check_fingerprint=True):
    """The sync guard on 4 freshly sampled rows, as the RL stage runs it."""
    rows = served(client, prompts).rows(torch.arange(4))
    with torch.no_grad():
        trainer = batched_logprobs(policy, rows, PARAMS.temperature)
    trainer_fp = weights_fingerprint(policy.named_parameters()) if check_fingerprint else None
    replica_fp = client.fingerprint() if check_fingerprint else None
    masked = rows.sampled_logprobs * rows.response_mask
    return check_weight_sync(trainer_fp, replica_fp, trainer, masked, rows.response_mask, 1e-3, check_fingerprint)


# --- one tiny replica, in order -------------------------------------------------------------------


def test_samples_equal_colocated_generation_bit_for_bit(client, policy, tiny):
    _, tokenizer, prompts = tiny
    generation = client.generate(prompts, PARAMS, SEED)
    batch = build_rollout_batch(tokenizer, prompts, generation, PARAMS.max_new_tokens)
    colocated = generate_rollouts(policy, tokenizer, prompts, PARAMS, SEED)
    assert torch.equal(batch.input_ids, colocated.input_ids)
    assert torch.equal(batch.response_mask, colocated.response_mask)
    assert batch.response_texts == colocated.response_texts
    assert batch.response_mask.sum(1).min() < PARAMS.max_new_tokens  # some rows ended at EOS
    assert torch.equal(colocated.sampled_logprobs, batch.sampled_logprobs)
    assert generation.versions == [[0] * len(row) for row in generation.response_ids]
    assert client.fingerprint() == weights_fingerprint(policy.named_parameters())


def test_a_batch_of_more_rows_than_a_thread_pool_holds_is_one_batch_still(client, policy, tiny):
    """Rows wait for their batch on the replica's event loop, not on threads: 320 rows, one batch."""
    prompts, params = tiny[2] * 20, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)
    generation = client.generate(prompts, params, SEED)
    colocated = generate_rollouts(policy, tiny[1], prompts, params, SEED)
    batch = build_rollout_batch(tiny[1], prompts, generation, params.max_new_tokens)
    assert len(prompts) == 320 and torch.equal(batch.input_ids, colocated.input_ids)


def test_generations_in_flight_together_come_back_each_its_own(client, tiny):
    prompts = tiny[2]
    sequential = [client.generate(prompts, PARAMS, seed) for seed in (SEED, SEED + 1)]
    first, second = client.submit(prompts, PARAMS, SEED), client.submit(prompts, PARAMS, SEED + 1)
    assert client.outstanding == 2
    assert [client.collect(second), client.collect(first)] == sequential[::-1]
    assert sequential[0] != sequential[1] and client.outstanding == 0
    with pytest.raises(ReplicaError, match="collect\\(\\) with no request outstanding"):
        client.collect()


def test_full_sync_after_a_training_like_change(client, policy, tiny):
    prompts = tiny[2]
    perturb(policy, seed=1)
    stats = client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB, version=1)
    assert stats.buckets >= 4 and stats.tensors == len(list(policy.parameters()))
    assert stats.bytes == sum(p.numel() * 4 for p in policy.parameters()) and stats.transport == "shm"
    assert all(s > 0 for s in stats.replica_s.values()) and sum(stats.replica_s.values()) < stats.seconds
    check = probe(client, policy, prompts)
    assert check.fingerprint_match and check.logprob_diff_max < 1e-5
    colocated = generate_rollouts(policy, tiny[1], prompts, PARAMS, SEED)  # still token-identical
    assert torch.equal(served(client, prompts).input_ids, colocated.input_ids)


@pytest.mark.parametrize("check_fingerprint", [True, False])
def test_skipped_sync_is_caught(client, policy, tiny, check_fingerprint):
    client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB, version=1)  # start in step
    perturb(policy, seed=2)  # ...and the trainer forgets to sync
    with pytest.raises(WeightSyncError) as err:
        probe(client, policy, tiny[2], check_fingerprint)
    check = err.value.check
    assert check.logprob_diff_max > 0.05  # 50x the stop
    assert "log-prob diff max" in str(err.value)
    if check_fingerprint:
        assert check.fingerprint_match is False and "fingerprints differ" in str(err.value)
    else:
        assert check.fingerprint_match is None and "fingerprint" not in str(err.value)


@pytest.mark.parametrize("check_fingerprint", [True, False])
def test_partial_sync_is_caught(client, policy, tiny, check_fingerprint):
    client.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB, version=1)
    perturb(policy, seed=3)
    buckets = list(iter_buckets(policy.named_parameters(), int(SMALL_BUCKET_MB * 2**20)))
    first_half = [(e.name, t) for b in buckets[: len(buckets) // 2] for e, t in zip(b.entries, b.tensors)]
    stats = client.update_weights(first_half, bucket_mb=SMALL_BUCKET_MB, version=2)
    assert stats.buckets == len(buckets) // 2 >= 2
    with pytest.raises(WeightSyncError) as err:
        probe(client, policy, tiny[2], check_fingerprint)
    assert err.value.check.logprob_diff_max > 0.05
    assert ("fingerprints differ" in str(err.value)) == check_fingerprint


@pytest.mark.parametrize("transport", ["gloo", "fsspec"])
def test_gloo_and_fsspec_channels_carry_the_weights_too(client, policy, tiny, tmp_path, transport):
    """A second trainer-side client on the same replica (the replica serves the one that attached last)."""
    perturb(policy, seed=4)
    url = (tmp_path / "weights").as_uri() if transport == "fsspec" else None
    key = client._headers["Authorization"].split()[1]
    other = ReplicaClient(client.url, key, tiny[1], name="hf-0", run_tag="test", transport=transport,
                          weights_url=url, timeout_s=60)  # fmt: skip
    try:
        stats = other.update_weights(policy.named_parameters(), bucket_mb=SMALL_BUCKET_MB, version=3)
        assert stats.transport == transport and stats.tensors == len(list(policy.parameters()))
        check = probe(other, policy, tiny[2])
        assert check.fingerprint_match and check.logprob_diff_max < 1e-5
    finally:
        other.close()
        client.channel.close()  # the replica serves the channel attached last: the next sync attaches again
    if transport == "fsspec":
        assert list((tmp_path / "weights").iterdir()) == []  # the channel removes what it wrote


def test_every_route_but_health_wants_the_key_and_bad_rows_are_refused_by_name(client, tiny):
    assert requests.get(client.url + "/health", timeout=5).status_code == 200
    for path in ("/update_weights", "/pause", "/start_weight_update", "/inference/v1/generate"):
        assert requests.post(client.url + path, json={}, timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert requests.post(client.url + path, json={}, headers=wrong, timeout=5).status_code == 401
    headers = client._headers
    answer = requests.post(client.url + "/inference/v1/generate", json={"token_ids": [5, 6]}, headers=headers,
                           timeout=5)  # fmt: skip
    assert answer.status_code == 400 and "malformed generate request" in answer.json()["error"]
    answer = requests.post(client.url + "/pause", params={"mode": "abort"}, headers=headers, timeout=5)
    assert answer.status_code == 400 and "use one of ['wait', 'keep']" in answer.json()["error"]
    answer = requests.post(client.url + "/update_weights", json={"update_info": {}}, headers=headers, timeout=5)
    assert answer.status_code == 400 and "needs a paused replica" in answer.json()["error"]
    signature = requests.get(client.url + "/rlflow/model_signature", headers=headers, timeout=5).json()
    with open(f"{tiny[0]}/config.json") as f:
        assert signature == model_signature(json.load(f)) and signature["hidden_size"] > 0


def test_pause_keep_cuts_a_generation_and_its_rows_go_on_under_the_new_weights(client, policy, tiny):
    """rollout.partial_rollouts: a weight update mid-generation; every token is scored by the weights
    its version names (the old ones up to the cut, the new ones after)."""
    prompts = tiny[2] * 4  # 64 rows: ~4 s of sampling here, so the cut lands mid-batch on a loaded machine too
    client.update_weights(policy.named_parameters(), SMALL_BUCKET_MB, version=4)
    old = {k: v.clone() for k, v in policy.state_dict().items()}
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=400)
    request = client.submit(prompts, params, seed=5)
    deadline = time.monotonic() + 120
    while client.gauge("rlflow:num_requests_running") != len(prompts):
        assert time.monotonic() < deadline, "the rows never all reached the replica's sampler"
        time.sleep(0.01)
    perturb(policy, seed=5, scale=0.05)
    client.update_weights(policy.named_parameters(), SMALL_BUCKET_MB, version=5, pause_mode="keep")
    generation = client.collect(request)
    spans = [sorted(set(v)) for v in generation.versions]
    assert [4, 5] in spans, spans  # cut and continued
    batch = build_rollout_batch(tiny[1], prompts, generation, params.max_new_tokens)
    with torch.no_grad():
        new = batched_logprobs(policy, batch, 1.0)
        policy.load_state_dict(old)
        before = batched_logprobs(policy, batch, 1.0)
    versions = torch.zeros_like(batch.response_mask, dtype=torch.long)
    for i, row in enumerate(generation.versions):
        versions[i, : len(row)] = torch.tensor(row)
    mask = batch.response_mask.bool()
    for version, trainer in ((4, before), (5, new)):
        sel = mask & (versions == version)
        assert sel.any() and (trainer[sel] - batch.sampled_logprobs[sel]).abs().max() < 1e-4
    perturb(policy, seed=5, scale=0.05)  # the trainer's weights are the replica's again (version 5)
    client.update_weights(policy.named_parameters(), SMALL_BUCKET_MB, version=5)


def test_a_replica_killed_mid_request_is_a_clear_error(client, tiny):
    prompts = tiny[2] * 4
    client.submit(prompts, SamplingParams(max_new_tokens=200), seed=0)  # 12800 tokens: seconds of work
    time.sleep(0.3)
    pid = client.pid
    start = time.monotonic()
    client.kill()
    with pytest.raises(ReplicaError) as err:
        client.collect()
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "rollout replica hf-0: /inference/v1/generate" in message
    assert f"the replica process {pid} is exited with code -9" in message and "hf-replica[" in message
    with pytest.raises(ReplicaError, match="could not connect"):  # and stays an error, never a hang
        client.generate(tiny[2], PARAMS, SEED)


# --- start-up failures and orphans ----------------------------------------------------------------


def test_a_replica_that_cannot_start_reports_its_log(tmp_path, tiny):
    with pytest.raises(ReplicaStartError, match=r"exited with code 2 while starting.*does not exist"):
        start_hf_replica(str(tmp_path / "missing"), log_path=str(tmp_path / "a.log"))
    with pytest.raises(ReplicaStartError, match=r"not healthy within 0\.5 s \(rollout\.startup_timeout_s\)"):
        start_hf_replica(tiny[0], startup_timeout_s=0.5, log_path=str(tmp_path / "b.log"))


TRAINER_SCRIPT = """
import sys
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.models.loading import load_tokenizer
sys.path.insert(0, sys.argv[3])
from helpers.hf_replica import hf_client
replica, client = hf_client(sys.argv[1], load_tokenizer(sys.argv[1]), sys.argv[2])
print(replica.proc.pid, flush=True)
client.generate([[5, 6, 7]] * 256, SamplingParams(max_new_tokens=240), seed=0)  # a minute of work: killed during it
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # a zombie has exited; its reaper may be slow
    except FileNotFoundError:
        return True


def test_a_replica_exits_when_the_trainer_dies_mid_request(tiny, tmp_path, request):
    tests_dir = str(request.config.rootpath / "tests")
    command = [sys.executable, "-c", TRAINER_SCRIPT, tiny[0], str(tmp_path / "replica.log"), tests_dir]
    trainer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        replica_pid = int(trainer.stdout.readline())
        threading.Event().wait(0.5)  # the replica is sampling: only its parent watchdog can notice
    finally:
        trainer.kill()  # SIGKILL: no finalizers, no close()
        trainer.wait()
    deadline = time.monotonic() + 5  # the watchdog polls every 0.5 s; the generation would take far longer
    while not _gone(replica_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(replica_pid)
    assert "trainer process" in (tmp_path / "replica.log").read_text()  # the watchdog ended it


def test_a_generate_body_is_read_as_vllm_sends_it_and_a_malformed_one_is_named():
    from rlflow.engine.rollout.hf_replica import row_request
    from rlflow.engine.rollout.hf_sampler import BatchKey, SamplerError

    sampling = {"temperature": 0.7, "max_tokens": 8, "seed": 5, "stop_token_ids": [2], "logprobs": 0}
    alone = row_request({"token_ids": [5, 6], "sampling_params": sampling})
    assert (alone.prompt, alone.temperature, alone.top_p, alone.max_tokens, alone.seed) == ([5, 6], 0.7, 1.0, 8, 5)
    assert alone.key is None and alone.stops == [2]
    hint = {"batch": "x-1", "rows": 4, "row": 2, "seed": 9, "pad": 0, "priority": True}
    row = row_request({"token_ids": [5], "sampling_params": sampling, "rlflow_batch": hint})
    assert row.row == 2 and row.key == BatchKey("x-1", 4, 9, 0, True)
    with pytest.raises(SamplerError, match=r"malformed generate request \(KeyError: 'max_tokens'\)"):
        row_request({"token_ids": [5], "sampling_params": {"stop_token_ids": [2]}})
    with pytest.raises(SamplerError, match="generate needs prompt ids, temperature > 0"):
        row_request({"token_ids": [5], "sampling_params": sampling | {"temperature": 0}})
