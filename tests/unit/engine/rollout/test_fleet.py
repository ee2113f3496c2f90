"""Two real vLLM replicas of the tiny demo model as one fleet: rows spread over both, weights to
both, a SIGKILLed replica dropped with its rows served by the other, and none left an error naming
them. Also the preflight of an external fleet (rollout.endpoints) against a real replica."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import requests
import torch

from helpers.vllm_env import vllm_python
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.errors import ConfigError
from rlflow.engine.models.loading import load_tokenizer
from rlflow.engine.rollout.fleet import ReplicaFleet
from rlflow.engine.rollout.replica import ReplicaClient, ReplicaError
from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV
from rlflow.engine.rollout.vllm_replica import VLLMOptions, VLLMReplica
from rlflow.engine.rollout.weight_sync import weights_fingerprint
from rlflow.flows.preflight import check_endpoints

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def model_dir(small_assets):
    return str(small_assets / "tiny-model")


@pytest.fixture(scope="module")
def replicas(model_dir, tmp_path_factory):
    python, logs = vllm_python(), tmp_path_factory.mktemp("fleet")
    started = []
    try:
        for i in range(2):
            options, log = VLLMOptions(cores="1", max_model_len=256), str(logs / f"{i}.log")
            started.append(VLLMReplica.start(model_dir, python=python, options=options, log_path=log))
        yield started
    finally:
        for replica in started:
            replica.close()


@pytest.fixture(scope="module")
def policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fleet(replicas, model_dir, policy):
    tokenizer = load_tokenizer(model_dir)
    clients = [
        ReplicaClient(r.url, r.key, tokenizer, name=f"vllm-{i}", on_failure=r.failure) for i, r in enumerate(replicas)
    ]
    fleet = ReplicaFleet(clients)
    fleet.update_weights(policy.named_parameters(), 0.05, version=0)
    yield fleet
    fleet.close()


def prompts(fleet, n: int) -> list[list[int]]:
    return [fleet.tokenizer.encode(f"hello number {i} is") for i in range(n)]


def served(replica) -> float:
    """Generations the replica finished (vllm:request_success_total, all reasons)."""
    text = requests.get(replica.url + "/metrics", headers={"Authorization": f"Bearer {replica.key}"}, timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    return sum(float(line.rsplit(" ", 1)[-1]) for line in lines)


def test_rows_spread_over_the_replicas_and_weights_reach_both(fleet, replicas, policy):
    before = [served(r) for r in replicas]
    generation = fleet.generate(prompts(fleet, 8), PARAMS, seed=1)
    assert len(generation.response_ids) == 8 and all(set(v) == {0} for v in generation.versions)
    assert [served(r) - b for r, b in zip(replicas, before)] == [4, 4]
    with torch.no_grad():
        policy.model.norm.weight.mul_(1.1)
    try:
        stats = fleet.update_weights(policy.named_parameters(), 0.05, version=1)
        assert stats.tensors == len(list(policy.named_parameters()))
        mine = weights_fingerprint(policy.named_parameters(), round_to=fleet.dtype)
        assert fleet.fingerprint() == mine  # both replicas reported the trainer's fingerprint
        assert all(set(v) == {1} for v in fleet.generate(prompts(fleet, 4), PARAMS, seed=1).versions)
    finally:
        with torch.no_grad():
            policy.model.norm.weight.div_(1.1)


def test_an_external_fleet_is_checked_before_anything_trains(replicas, model_dir, smollm2_dir, monkeypatch):
    url = replicas[0].url
    monkeypatch.delenv(REPLICA_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"set {REPLICA_KEY_ENV} in the environment"):
        check_endpoints([url])
    monkeypatch.setenv(REPLICA_KEY_ENV, "wrong")
    with pytest.raises(ConfigError, match=rf"rollout.endpoints: {url} refused the key in {REPLICA_KEY_ENV} \(401\)"):
        check_endpoints([url])
    monkeypatch.setenv(REPLICA_KEY_ENV, replicas[0].key)
    check_endpoints([url])
    check_endpoints([url], model_dir)  # it serves the tiny model: its weights fit
    with pytest.raises(ConfigError) as err:  # SmolLM2's would not: refused before any weight travels
        check_endpoints([url], smollm2_dir)
    assert str(err.value).startswith(f"rollout.endpoints: {url} serves another model than model.path={smollm2_dir}")
    hidden = [json.loads((Path(d) / "config.json").read_text())["hidden_size"] for d in (model_dir, smollm2_dir)]
    assert f"hidden_size {hidden[0]} != {hidden[1]}" in str(err.value) and "point rollout.endpoints" in str(err.value)
    with pytest.raises(ConfigError, match=r"rollout.endpoints: http://127.0.0.1:9 is unreachable"):
        check_endpoints([url, "http://127.0.0.1:9"], timeout_s=5)


def test_a_killed_replicas_rows_go_to_the_survivor_and_none_left_is_an_error(fleet, replicas, caplog):
    """Last: it kills both replicas."""
    os.killpg(replicas[1].proc.pid, signal.SIGKILL)
    replicas[1].proc.wait(timeout=60)
    with caplog.at_level(logging.WARNING, logger="rlflow.engine.rollout.fleet"):
        generation = fleet.generate(prompts(fleet, 6), PARAMS, seed=2)
    assert len(generation.response_ids) == 6 and all(generation.response_ids)
    assert set(fleet.dead) == {"vllm-1"}
    assert "rollout replica vllm-1 dropped from the fleet" in caplog.text
    os.killpg(replicas[0].proc.pid, signal.SIGKILL)
    replicas[0].proc.wait(timeout=60)
    none_left = r"rollout fleet: no replica left \(vllm-1, vllm-0\); vllm-1: .*code -9"
    with pytest.raises(ReplicaError, match=none_left) as err:
        fleet.generate(prompts(fleet, 2), PARAMS, seed=3)
    assert "vllm-0: rollout replica vllm-0: /inference/v1/generate could not connect" in str(err.value)
