"""rlflow's weight-transfer engines for vLLM, registered through vLLM's own factory.

vLLM 0.32 moves trainer weights into a replica through `WeightTransferEngine`s chosen by
`--weight-transfer-config '{"backend": ...}'`; its built-in ones (nccl, ipc) need a GPU. These serve
the CPU, and any replica that shares a host with its trainer:

backend `rlflow` (`--weight-transfer-config {"backend": "rlflow"}`): the bytes come through the
channel the trainer chose at `/init_weight_transfer_engine` (engine/rollout/transfer_receiver.py:
`shm`, a memfd on this host; `gloo`, a two-rank group with a trainer anywhere; `fsspec`, safetensors
files in a folder both reach), as they do into the HF replica.

The tensors go to `model.load_weights`, which maps HF names onto vLLM's fused layers
(qkv_proj, gate_up_proj) and converts the dtype, and the replica reports back (engine/rollout/staging.py
format, through the same channel): its weight dtype at init, and after each update the count and the
fingerprint of what it loaded (per-tensor digests rounded to that dtype), which the trainer compares with
its own.
vLLM's `weight_checker` cannot serve here: on the CPU its checksums of the repacked linear layers hash
empty tensors, so they would not see a skipped update of those layers.

Every update runs vLLM's layerwise-reload lifecycle (as its NCCL engine does): a backend that repacks
weights after loading (the CPU's linear kernels do) repacks the new ones in `finish_weight_update`.

Loaded by vLLM in each of its processes through the `vllm.general_plugins` entry point (`register`);
this module imports vLLM, so only the replica's environment (.venv-vllm) imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlflow.engine.rollout.transfer_receiver import BucketUpdate, ReplicaChannel, TransferInit, UpdateClock
from rlflow.engine.rollout.weight_sync import fingerprint_from_digests, tensor_digest

BACKEND = "rlflow"


@dataclass
class RlflowInitInfo(TransferInit, WeightTransferInitInfo):
    """TransferInit, typed for vLLM's factory."""


@dataclass
class RlflowUpdateInfo(BucketUpdate, WeightTransferUpdateInfo):
    """BucketUpdate, typed for vLLM's factory."""


class RlflowTransferEngine(WeightTransferEngine[RlflowInitInfo, RlflowUpdateInfo]):
    init_info_cls = RlflowInitInfo
    update_info_cls = RlflowUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: ReplicaChannel | None = None
        self.digests: dict[str, tuple[tuple[int, ...], str]] = {}  # of the tensors loaded since the start
        self.clock = UpdateClock()

    def init_transfer_engine(self, init_info: RlflowInitInfo) -> None:
        self.shutdown()
        try:
            self.channel = ReplicaChannel(init_info)
        except ValueError as exc:
            raise ValueError(f"{BACKEND}: {exc}") from None
        self.channel.report({"dtype": self._dtype()})

    def _dtype(self) -> str:
        return str(self.model_config.dtype).removeprefix("torch.")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.digests = {}
        self.clock.reset()
        with self.clock.phase("load"):
            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host;
        # loading here is synchronous on every device this engine serves.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RlflowUpdateInfo) -> None:
        if self.channel is None:
            raise RuntimeError(f"{BACKEND}: /update_weights before /init_weight_transfer_engine")
        with self.clock.phase("receive"):
            try:
                weights = self.channel.receive(update_info)
            except ValueError as exc:
                raise ValueError(f"{BACKEND}: {exc}") from None
            # copy=True: the layerwise reload keeps these tensors until their layer is complete, which may
            # be buckets later, and by then the next bucket has overwritten the channel's buffer.
            weights = [(name, tensor.to(self.device, copy=True)) for name, tensor in weights]
        with self.clock.phase("load"):
            self.model.load_weights(weights=weights)
        with self.clock.phase("fingerprint"):
            for name, tensor in weights:
                digest = tensor_digest(tensor, self.model_config.dtype) if self.channel.init.fingerprint else ""
                self.digests[name] = (tuple(tensor.shape), digest)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self.clock.phase("load"):
            finalize_layerwise_reload(self.model, self.model_config)
            self._repack_tied_head()
        with self.clock.phase("fingerprint"):
            fingerprint = fingerprint_from_digests(self.digests) if self.channel.init.fingerprint else None
        report = {"dtype": self._dtype(), "tensors": len(self.digests), "fingerprint": fingerprint}
        self.channel.report(report | self.clock.report())

    def _repack_tied_head(self) -> None:
        """vLLM 0.32 on the CPU packs every linear layer's weight for oneDNN after loading, the tied
        lm_head's too (a copy of the embedding). Its load_weights skips lm_head.weight when tied, so
        the reload never repacks it: without this, a replica samples with the new embedding and the
        old output layer (measured: 0.86 nats off after scaling the embedding by 1.3). On a GPU
        nothing is packed (no cpu_linear) and this does nothing."""
        head = getattr(self.model, "lm_head", None)
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False) or not hasattr(head, "cpu_linear"):
            return
        head.quant_method.process_weights_after_loading(head)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every one of its processes."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlflowTransferEngine")
    except ValueError:  # registered already: vLLM loads plugins more than once in one process
        pass
