"""The replica's side of the weight channels, against the trainer's own channels, in this process:
every transport carries every tensor and the report back; what a replica must refuse, it refuses by name."""

from __future__ import annotations

import pytest
import torch

from helpers.transfer_peer import ChannelPeer
from rlflow.engine.rollout.transfer import make_channel
from rlflow.engine.rollout.transfer_receiver import BucketUpdate, ReplicaChannel, TransferInit
from rlflow.engine.rollout.weight_sync import iter_buckets

WEIGHTS = {
    "embed.weight": torch.randn(50, 16, generator=torch.Generator().manual_seed(0)),
    "layer.0.bias": torch.arange(7, dtype=torch.float32),
    "layer.0.weight": torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
}


@pytest.mark.parametrize("transport", ["shm", "gloo", "fsspec"])
def test_every_transport_delivers_every_tensor_bit_for_bit_and_the_replicas_reports(transport, tmp_path):
    url = (tmp_path / "weights").as_uri() if transport == "fsspec" else None
    channel = make_channel(transport, fingerprint=True, timeout_s=30, url=url)
    peer = ChannelPeer(dtype="bfloat16")
    assert channel.attach(peer, 2048) == {"dtype": "bfloat16"}
    assert peer.channel.transport == transport and peer.channel.init.fingerprint is True
    buckets = list(iter_buckets(WEIGHTS.items(), 2048))
    assert len(buckets) >= 2  # the 3.2 KB embedding alone, larger than the slot asked for
    for index, bucket in enumerate(buckets):
        if bucket.nbytes > channel.slot_bytes:
            channel.attach(peer, bucket.nbytes)
        channel.send(peer, bucket, index)
    assert channel.finish(peer) == {"dtype": "bfloat16", "tensors": 3}
    for name, tensor in WEIGHTS.items():
        assert peer.loaded[name].dtype == tensor.dtype and torch.equal(peer.loaded[name], tensor)
    channel.close()
    peer.channel.close()


def test_a_bucket_outside_the_shared_memory_or_a_file_outside_the_folder_is_refused(tmp_path):
    channel = make_channel("shm", fingerprint=False, timeout_s=30)
    peer = ChannelPeer()
    channel.attach(peer, 1024)
    nbytes = channel.staging.nbytes
    with pytest.raises(ValueError, match=rf"bucket \[{nbytes - 8}, {nbytes + 8}\) outside the shm buffer of {nbytes}"):
        peer.channel.receive(BucketUpdate(offset=nbytes - 8, nbytes=16))
    channel.close()
    folder = ReplicaChannel(TransferInit(transport="fsspec", nbytes=0, url=(tmp_path / "w").as_uri()))
    for name in ("../secrets.safetensors", "sub/bucket.safetensors", ".hidden", None):
        with pytest.raises(ValueError, match="is not a plain file name in"):
            folder.receive(BucketUpdate(offset=0, nbytes=0, file=name))
    with pytest.raises(ValueError, match=r"unknown weight transport 'nccl'; use one of \['shm', 'gloo', 'fsspec'\]"):
        ReplicaChannel(TransferInit(transport="nccl", nbytes=0))
