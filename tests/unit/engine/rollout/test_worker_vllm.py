"""The vLLM worker's parts that run without vLLM (which the project environment cannot hold): the
per-row seeds, the error when vLLM is missing, and the fingerprint it keeps from the checkpoint
and each received tensor, which must equal the trainer's. vLLM's engine itself is stood in for by
a recorder of the RPC it would receive (the real one is tests/unit/engine/rollout/test_server.py's
skipped GPU test)."""

import importlib.util

import pytest
import torch

from rlflow.engine.models.loading import load_policy
from rlflow.engine.rollout.weight_sync import iter_buckets, pack_bucket, weights_fingerprint
from rlflow.engine.rollout.worker import BucketSource, RequestError
from rlflow.engine.rollout.worker_vllm import VLLMBackend, make_backend, row_seed

NO_VLLM = importlib.util.find_spec("vllm") is None


class RecordedEngine:
    """What the backend asks of vllm.LLM after start: the RPC and the cache reset, recorded."""

    def __init__(self):
        self.rpcs, self.resets = [], 0

    def collective_rpc(self, method, args):
        self.rpcs.append((method, args))

    def reset_prefix_cache(self):
        self.resets += 1


def backend_without_engine(model_dir, dtype):
    """A VLLMBackend whose checkpoint digests are real and whose engine is the recorder (its
    __init__ would start vLLM)."""
    backend = VLLMBackend.__new__(VLLMBackend)
    backend.dtype = dtype
    backend.llm = RecordedEngine()
    backend.digests = backend._checkpoint_digests(model_dir)
    return backend


def test_each_row_of_a_request_gets_its_own_seed_in_range():
    seeds = [row_seed(7, i) for i in range(4)]
    assert len(set(seeds)) == 4 and seeds[0] == 7 * 1_000_003
    assert seeds == [row_seed(7, i) for i in range(4)]  # deterministic
    assert 0 <= row_seed(2**62, 5) < 2**63  # vLLM's seed is a signed 64-bit integer


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here: the missing-vLLM error cannot happen")
def test_starting_the_backend_without_vllm_fails_naming_vllm(tmp_path):
    import argparse

    args = argparse.Namespace(model_dir=str(tmp_path), dtype="bfloat16", trust_remote_code=False)
    with pytest.raises(ModuleNotFoundError, match="vllm"):
        make_backend(args)


def test_the_starting_fingerprint_is_the_trainers_of_the_same_checkpoint(small_assets):
    model_dir = str(small_assets / "tiny-model")
    backend = backend_without_engine(model_dir, torch.bfloat16)
    policy = load_policy(model_dir)
    assert backend.describe() == {"tensors": len(backend.digests)}
    assert backend.fingerprint() == weights_fingerprint(policy.named_parameters(), round_to=torch.bfloat16)
    assert backend.fingerprint() != weights_fingerprint(policy.named_parameters())  # the bf16 rounding counts


def test_a_loaded_bucket_updates_the_fingerprint_and_goes_to_the_engine_by_path(small_assets):
    model_dir = str(small_assets / "tiny-model")
    backend = backend_without_engine(model_dir, torch.float32)
    policy = load_policy(model_dir)
    name, param = next(iter(policy.named_parameters()))
    with torch.no_grad():
        param.add_(0.25)
    (bucket,) = iter_buckets([(name, param)], bucket_bytes=1 << 30)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, buffer)
    backend.load(list(bucket.entries), BucketSource(buffer, "/proc/1/fd/9", 4096))
    backend.end_update()
    assert backend.fingerprint() == weights_fingerprint(policy.named_parameters())
    assert backend.llm.rpcs == [
        ("rlflow_load_bucket", ("/proc/1/fd/9", 4096, bucket.nbytes, [e.to_json() for e in bucket.entries]))
    ]
    assert backend.llm.resets == 1  # cached KV blocks were computed with the old weights


def test_inline_bytes_are_refused_the_worker_reads_shared_memory(small_assets):
    backend = backend_without_engine(str(small_assets / "tiny-model"), torch.float32)
    with pytest.raises(RequestError, match="call update_weights.transport='shm'."):
        backend.load([], BucketSource(torch.zeros(0, dtype=torch.uint8), None, 0))
    assert backend.llm.rpcs == []
