"""The trainer's side of the weight channels, against a peer that follows the replica's side of the
wire (engine/rollout/vllm_transfer.py, which needs vLLM: test_vllm_replica.py runs the real one).
The peer here joins the same gloo group or opens the same memfd, as a replica on another host or on
this one would, and answers each HTTP route the way the engine does."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers.transfer_peer import ChannelPeer
from rlflow.engine.rollout.staging import REPORT_BYTES, read_report, write_report
from rlflow.engine.rollout.transfer import GlooChannel, SharedMemoryChannel
from rlflow.engine.rollout.weight_sync import TensorEntry, iter_buckets, unpack_bucket

WEIGHTS = {f"layer.{i}.weight": torch.randn(64, 32, generator=torch.Generator().manual_seed(i)) for i in range(6)}


def test_gloo_carries_every_bucket_and_the_replicas_report():
    peer, channel = ChannelPeer(), GlooChannel("127.0.0.1", timeout_s=30)
    assert channel.attach(peer, 4096) == {"dtype": "float32"}
    buckets = list(iter_buckets(WEIGHTS.items(), 4096))
    assert len(buckets) == 6  # 8 KB tensors: one bucket each, larger than the 4 KB asked for
    for index, bucket in enumerate(buckets):
        if bucket.nbytes > channel.slot_bytes:
            channel.attach(peer, bucket.nbytes)
        channel.send(peer, bucket, index)
    assert channel.finish(peer) == {"dtype": "float32", "tensors": 6}
    assert all(torch.equal(peer.loaded[name], tensor) for name, tensor in WEIGHTS.items())
    channel.close()


def test_a_refused_update_stops_the_trainers_broadcast_at_once_not_at_the_timeout():
    peer, channel = ChannelPeer(refuse="/update_weights"), GlooChannel("127.0.0.1", timeout_s=300)
    channel.attach(peer, 1 << 16)
    bucket = next(iter(iter_buckets(WEIGHTS.items(), 1 << 16)))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="/update_weights refused"):
        channel.send(peer, bucket, 0)
    assert time.monotonic() - started < 60
    channel.close()


def test_shared_memory_is_the_replicas_to_read_and_to_answer_in():
    loaded = {}

    def peer(path: str, body: dict | None) -> dict:
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            with open(info["path"], "r+b") as f:  # what a replica on this host opens
                peer.memory = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
                peer.path = info["path"]
            assert info["transport"] == "shm" and info["fingerprint"] is False
            with open(info["path"], "r+b") as f:
                report = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
                write_report(report, {"dtype": "bfloat16"})
                f.write(report.numpy().tobytes())
        elif path == "/update_weights":
            info = body["update_info"]
            with open(peer.path, "rb") as f:
                f.seek(info["offset"])
                data = torch.frombuffer(bytearray(f.read(info["nbytes"])), dtype=torch.uint8)
            entries = [TensorEntry.from_json(t) for t in info["tensors"]]
            loaded.update({name: view.clone() for name, view in unpack_bucket(entries, data)})
        elif path == "/finish_weight_update":
            with open(peer.path, "r+b") as f:
                report = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
                write_report(report, {"tensors": len(loaded)})
                f.write(report.numpy().tobytes())
        return {}

    channel = SharedMemoryChannel(fingerprint=False)
    assert channel.attach(peer, 1 << 16) == {"dtype": "bfloat16"}
    for index, bucket in enumerate(iter_buckets(WEIGHTS.items(), 1 << 14)):
        channel.send(peer, bucket, index)
    assert channel.finish(peer) == {"tensors": 6}
    assert all(torch.equal(loaded[name], tensor) for name, tensor in WEIGHTS.items())
    assert read_report(channel.staging.buffer) == {"tensors": 6}
    channel.close()


def test_a_peer_that_never_answers_is_a_timeout_not_a_hang():
    def silent(path: str, body: dict | None) -> dict:
        threading.Event().wait(5)  # joins nothing
        return {}

    channel = GlooChannel("127.0.0.1", timeout_s=2)
    started = time.monotonic()
    with pytest.raises(Exception, match="(?i)timeout|timed out|within"):
        channel.attach(silent, 1024)
    assert time.monotonic() - started < 30


def test_the_configs_transports_are_the_channels_and_an_unknown_one_lists_them():
    import typing

    from rlflow.engine.config.execution import RolloutConfig
    from rlflow.engine.rollout.transfer import TRANSPORTS, make_channel

    annotation = RolloutConfig.model_fields["transport"].annotation
    assert set(typing.get_args(annotation)) == {"auto", *TRANSPORTS}
    with pytest.raises(ValueError, match=r"unknown weight transport 'nccl'; use one of \['shm', 'gloo', 'fsspec'\]"):
        make_channel("nccl", fingerprint=True, timeout_s=1)
    with pytest.raises(ValueError, match="needs a folder both sides reach"):
        make_channel("fsspec", fingerprint=True, timeout_s=1)
