"""Weight sync's pure parts: buckets (grouping, aligned layout, pack and unpack), the fingerprint,
and the guard's check and its messages."""

import json

import pytest
import torch

from rlflow.engine.rollout.weight_sync import (
    ALIGN,
    TensorEntry,
    WeightSyncError,
    check_weight_sync,
    dtype_from_name,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
    weights_fingerprint,
)



def test_buckets_group_tensors_and_a_large_tensor_travels_alone():
    named = [("a", torch.ones(10)), ("b", torch.ones(100)), ("c", torch.ones(5)), ("d", torch.ones(3, 2))]
    buckets = list(iter_buckets(named, bucket_bytes=200))
    assert [[e.name for e in b.entries] for b in buckets] == [["a"], ["b"], ["c", "d"]]
    assert buckets[1].nbytes == 448 and buckets[2].entries[1].offset == 64  # 64-byte aligned
    named_bf16 = [("x", torch.randn(7).bfloat16()), ("y", torch.arange(6).reshape(2, 3))]
    for bucket in iter_buckets(named_bf16, bucket_bytes=1 << 20):
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_bucket(bucket, buffer)
        entries = [TensorEntry.from_json(json.loads(json.dumps(e.to_json()))) for e in bucket.entries]
        out = dict(unpack_bucket(entries, buffer))
        assert torch.equal(out["x"], named_bf16[0][1]) and torch.equal(out["y"], named_bf16[1][1])


def test_fingerprint_is_order_and_dtype_independent():
    torch.manual_seed(0)
    named = [("w", torch.randn(4, 3)), ("b", torch.randn(3))]
    fingerprint = weights_fingerprint(named)
    assert fingerprint.startswith("sha256:") and fingerprint == weights_fingerprint(reversed(named))
    changed = [("w", named[0][1].clone()), named[1]]
    changed[0][1][0, 0] += 1e-7
    assert weights_fingerprint(changed) != fingerprint
    as_bf16 = [(n, t.bfloat16()) for n, t in named]  # what a bf16 worker holds after copy_
    assert weights_fingerprint(as_bf16) == weights_fingerprint([(n, t.float()) for n, t in as_bf16])
    assert weights_fingerprint(named, round_to=torch.bfloat16) == weights_fingerprint(as_bf16) != fingerprint


def test_check_weight_sync_names_the_check_the_numbers_and_the_config_keys():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    ok = check_weight_sync("sha256:a", "sha256:a", trainer, trainer + 1e-6, mask, 1e-3, True)
    assert ok.fingerprint_match and ok.tokens == 2 and ok.logprob_diff_max < 2e-6
    worker = trainer + torch.tensor([[0.0, 0.02, 5.0]])  # the masked 5.0 does not count
    with pytest.raises(WeightSyncError, match=r"log-prob diff max 0\.02 .*rollout\.max_logprob_diff=0\.001") as err:
        check_weight_sync(None, None, trainer, worker, mask, 1e-3, False)
    assert err.value.check.logprob_diff_max == pytest.approx(0.02) and err.value.check.fingerprint_match is None
    with pytest.raises(WeightSyncError, match=r"fingerprints differ .*rollout\.check_fingerprint=true"):
        check_weight_sync("sha256:a", "sha256:b", trainer, trainer, mask, 1e-3, True)
    assert check_weight_sync("sha256:a", "sha256:b", trainer, trainer, mask, 1e-3, False).fingerprint_match is False


def test_every_tensor_starts_on_an_aligned_offset_and_the_bucket_covers_the_last_one():
    named = [("a", torch.ones(3)), ("b", torch.ones(5, dtype=torch.float64)), ("c", torch.ones(1, dtype=torch.int8))]
    (bucket,) = iter_buckets(named, bucket_bytes=1 << 20)
    # a: 12 bytes at 0; b: 40 bytes at 64; c: 1 byte at 128; the layout ends on the next boundary
    assert [e.offset for e in bucket.entries] == [0, ALIGN, 2 * ALIGN]
    assert bucket.nbytes == 3 * ALIGN
    assert [e.nbytes for e in bucket.entries] == [12, 40, 1]


def test_a_non_positive_bucket_size_names_the_config_key():
    with pytest.raises(WeightSyncError, match=r"bucket size must be positive \(got 0 bytes\); raise rollout\.bucket_mb"):
        list(iter_buckets([("a", torch.ones(1))], bucket_bytes=0))


def test_an_unknown_dtype_in_a_bucket_layout_is_refused():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(WeightSyncError, match="unsupported tensor dtype 'complex64'"):
        TensorEntry.from_json({"name": "w", "dtype": "complex64", "shape": [2], "offset": 0})


def test_an_entry_beyond_the_buffer_is_refused_not_read():
    entry = TensorEntry("w", "float32", (4,), 8)  # bytes 8..24
    with pytest.raises(WeightSyncError, match="tensor 'w' ends at byte 24 beyond the bucket's 16"):
        list(unpack_bucket([entry], torch.zeros(16, dtype=torch.uint8)))


def test_the_probe_shapes_must_agree():
    with pytest.raises(WeightSyncError, match=r"shapes differ: trainer \(1, 2\), replica \(1, 3\), mask \(1, 2\)"):
        check_weight_sync(None, None, torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), 1e-3, False)


def test_the_check_reports_the_mean_and_max_over_masked_tokens_and_fails_on_nan():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    trainer = torch.zeros(1, 4)
    worker = torch.tensor([[0.001, -0.002, 0.0, 9.0]])
    check = check_weight_sync("sha256:x", "sha256:x", trainer, worker, mask, 0.01, True)
    assert check.tokens == 3 and check.fingerprint_match is True
    assert check.logprob_diff_mean == pytest.approx(0.001) and check.logprob_diff_max == pytest.approx(0.002)
    with pytest.raises(WeightSyncError, match="log-prob diff max nan"):
        check_weight_sync(None, None, trainer, torch.full((1, 4), float("nan")), mask, 0.01, False)
