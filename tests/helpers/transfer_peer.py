"""A replica's side of the weight channels in this process: the real ReplicaChannel behind a callable
that stands where a replica's HTTP routes would (the trainer's channel calls it as it calls them)."""

from __future__ import annotations

import torch

from rlflow.engine.rollout.transfer_receiver import BucketUpdate, ReplicaChannel, TransferInit


class ChannelPeer:
    def __init__(self, refuse: str | None = None, dtype: str = "float32"):
        self.channel: ReplicaChannel | None = None
        self.loaded: dict[str, torch.Tensor] = {}
        self.refuse, self.dtype = refuse, dtype

    def __call__(self, path: str, body: dict | None) -> dict:
        if path == self.refuse:
            raise RuntimeError(f"{path} refused")
        if path == "/init_weight_transfer_engine":
            self.channel = ReplicaChannel(TransferInit(**body["init_info"]))
            self.channel.report({"dtype": self.dtype})
        elif path == "/update_weights":
            weights = self.channel.receive(BucketUpdate(**body["update_info"]))
            self.loaded |= {name: tensor.clone() for name, tensor in weights}  # the buffer is reused
        elif path == "/finish_weight_update":
            self.channel.report({"dtype": self.dtype, "tensors": len(self.loaded)})
        return {}
